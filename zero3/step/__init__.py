"""The optimizer step: the sharded optimizer over its layout (sub-groups of shards, their masters and states),
the gradient shards it steps from, the steps begun during the backward, the loss scale and the schedules."""
