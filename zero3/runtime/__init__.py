"""The training runtime: `zero3.initialize`, the engine, and the parts it drives (module hooks and the
lockstep gather walk, the gradient hooks and reducer, the sharded optimizer), built in `build`."""
