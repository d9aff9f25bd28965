"""The forward and backward passes: the module hooks and the lockstep gather walk that bring each unit in,
the gradient hooks, and the reducer that reduce-scatters each gradient into its shard."""
