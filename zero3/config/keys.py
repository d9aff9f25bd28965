"""The key tables, as data: what each DeepSpeed key and each of zero3's own keys does here, and the
`optimizer` and `scheduler` types. The configuration reference (reference.py) prints them."""

from __future__ import annotations

# Keys whose "no effect" note ignored_settings() words itself (it depends on the value).
_NOTED_ELSEWHERE = frozenset({
    "zero_optimization.stage3_max_reuse_distance", "zero_optimization.contiguous_gradients",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save",
})

# [Note: DeepSpeed's keys in zero3]
# Every key of DeepSpeed's ZeRO config (`DeepSpeedZeroConfig`, 0.19.8) and the
# top-level keys ZeRO-3 users write, with what each does here: "implemented"
# (it does what DeepSpeed's does), "translated" (a deprecated name, read as
# DeepSpeed reads it, with a warning), "no effect" (validated for type; one
# info line at initialize says why), or "off only" (a feature zero3 does not
# offer yet: accepted at the value that leaves it off, a clear error
# otherwise). A key given under both of its names (`stage3_x` and `x`) is an
# error. docs/configuration.md prints this table (see [Note: the configuration reference]).
DEEPSPEED_KEYS: dict[str, tuple[str, str]] = {
    "zero_optimization.stage": ("implemented", "3; other stages are refused"),
    "zero_optimization.stage3_param_persistence_threshold": (
        "implemented", "parameters this small stay gathered"),
    "zero_optimization.mics_shard_size": (
        "implemented", "MiCS: every state sharded within groups of this many ranks (consecutive ranks), "
        "replicated across the groups; gradients reduce-scattered in the group each micro-step and "
        "summed across the replicas once per step; -1: one group of every rank. Must divide the world size. The same layout as "
        "`zero3.initialize(mesh=...)` with a 2-D (replicate, shard) DeviceMesh"),
    "zero_optimization.mics_hierarchical_params_gather": (
        "no effect", "zero3 gathers a MiCS shard group's parameters in one all-gather on the group's own "
        "communicator, whose library (NCCL) already routes it across nodes hierarchically"),
    "zero_optimization.stage3_model_persistence_threshold": (
        "implemented", "caps the elements kept gathered in all"),
    "zero_optimization.stage3_prefetch_bucket_size": (
        "implemented", "elements gathered ahead of use"),
    "zero_optimization.stage3_max_live_parameters": (
        "implemented", "elements gathered at once"),
    "zero_optimization.reduce_bucket_size": ("implemented", "elements per gradient reduce-scatter"),
    "zero_optimization.overlap_comm": ("implemented", "reductions overlap backward (two bucket slots)"),
    "zero_optimization.sub_group_size": ("implemented", "elements the optimizer steps at a time"),
    "zero_optimization.offload_param": ("implemented", "the 16-bit parameters on the host or on disk"),
    "zero_optimization.offload_optimizer": ("implemented", "the optimizer state on the host or on disk"),
    "zero_optimization.ignore_unused_parameters": (
        "implemented", "false: a step where a trained parameter got no gradient on any rank raises"),
    "zero_optimization.reduce_scatter": (
        "no effect", "zero3 always reduce-scatters gradients; DeepSpeed's false (an all-reduce, each rank then "
        "keeping its partition) leaves every rank the same gradient shard"),
    "zero_optimization.cpu_offload": ("translated", "true: offload_optimizer.device = 'cpu'"),
    "zero_optimization.cpu_offload_param": ("translated", "true: offload_param.device = 'cpu'"),
    "zero_optimization.cpu_offload_use_pin_memory": (
        "translated", "a warning only, as in DeepSpeed: set offload_*.pin_memory"),
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": (
        "translated", "read as stage3_gather_16bit_weights_on_model_save"),
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": (
        "no effect", "save_16bit_model always writes the whole model, gathering one parameter at a time"),
    "zero_optimization.stage3_max_reuse_distance": (
        "no effect", "a unit is released once nothing holds it and gathered again ahead of its next use"),
    "zero_optimization.stage3_module_granularity_threshold": (
        "implemented", "modules with fewer parameter elements per layer become leaf modules (one unit)"),
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": (
        "no effect", "zero3 fetches parameters with an all-gather, which gives the same values"),
    "zero_optimization.stage3_allgather_sequential": (
        "no effect", "zero3 issues gathers in one agreed order (the lockstep walk)"),
    "zero_optimization.contiguous_gradients": ("no effect", "gradients always reduce into one flat buffer"),
    "zero_optimization.enable_sanity_checks": (
        "implemented", "true: an in-place edit of a parameter inside GatheredParameters without a modifier rank "
        "raises on every rank, as DeepSpeed's check does (false: it is discarded with one warning)"),
    "zero_optimization.allgather_partitions": ("no effect", "a ZeRO stage 1/2 setting"),
    "zero_optimization.allgather_bucket_size": ("no effect", "a ZeRO stage 1/2 setting"),
    "zero_optimization.use_multi_rank_bucket_allreduce": ("no effect", "a ZeRO stage 1/2 setting"),
    "zero_optimization.legacy_stage1": ("no effect", "a ZeRO stage 1 setting"),
    "zero_optimization.round_robin_gradients": ("no effect", "a ZeRO stage 1/2 setting"),
    "zero_optimization.load_from_fp32_weights": (
        "no effect", "zero3's checkpoints hold the fp32 masters, and a load always reads them"),
    "zero_optimization.elastic_checkpoint": ("no effect", "zero3's checkpoints load at any world size"),
    "zero_optimization.parameter_alignment": ("no effect", "shards are padded to whole elements per rank"),
    "zero_optimization.memory_efficient_linear": (
        "no effect", "backward re-gathers what nn.Linear saved through saved-tensor hooks, for any module"),
    "zero_optimization.pipeline_loading_checkpoint": ("no effect", "a pipeline-parallel setting"),
    "zero_optimization.override_module_apply": (
        "no effect", "module.apply on a partitioned model: gather under zero3.GatheredParameters"),
    "zero_optimization.log_trace_cache_warnings": ("no effect", "zero3 logs trace changes at debug level"),
    "zero_optimization.save_muon_momentum_buffer_in_memory": (
        "no effect", "Muon's momentum is a state of zero3's optimizer tier like any other"),
    "zero_optimization.compute_grad_norm": ("off only", "true; false is a ZeRO stage 1/2 setting"),
    "zero_optimization.zero_hpz_partition_size": (
        "implemented", "hpZ: after each forward a secondary 16-bit shard within groups of this many "
        "consecutive ranks (a node), from which the backward gathers on the node; 2P/K bytes per rank; "
        "1 or 0: off. Must divide the shard group (world size, or mics_shard_size) and the ranks per node"),
    "zero_optimization.zero_quantized_weights": (
        "implemented", "ZeRO++ qwZ: every parameter all-gather carries int8 blocks of 256 with an fp32 scale "
        "each (half the bytes of bf16); the shards, masters, checkpoints, exports, iter_full_params and "
        "GatheredParameters (between steps) stay exact"),
    "zero_optimization.zero_quantized_nontrainable_weights": (
        "implemented", "qwZ for the gathers of frozen parameters only (a LoRA base model); the frozen "
        "shards stay 16-bit at rest, so exports and checkpoints stay exact"),
    "zero_optimization.zero_quantized_gradients": (
        "implemented", "ZeRO++ qgZ: each gradient reduce-scatter is an int4 block-quantized all-to-all inside "
        "the node, then one across the nodes (a quarter of bf16's bytes, and only 1/L of them cross); the "
        "reduced gradients, masters and optimizer states stay in their own precision"),
    "zero_optimization.zenflow": ("off only", "absent; ZenFlow is not offered"),
    "zero_optimization.leaf_module": (
        "implemented", "classes, names, name_suffixes: each such module's parameters are one gather unit"),
    "zero_allow_untested_optimizer": ("no effect", "zero3 steps any elementwise torch optimizer"),
    "zero_force_ds_cpu_optimizer": ("no effect", "the host step is torch's fused kernel, not DeepSpeed's"),
    "activation_checkpointing": (
        "implemented", "cpu_checkpointing, synchronize_checkpoint_boundary and profile configure "
        "deepspeed.checkpointing.checkpoint (torch's non-reentrant checkpoint, re-gathered by zero3); "
        "partition_activations and contiguous_memory_optimization are refused (no model parallelism)"),
    "checkpoint.tag_validation": (
        "no effect", "a save always refuses different tags on different ranks (DeepSpeed's \"Fail\")"),
    "checkpoint.load_universal": (
        "off only", "false; zero3's own checkpoints load at any world size with no conversion"),
    "checkpoint.use_node_local_storage": (
        "no effect", "every rank writes its own files; a load at another world size reads other ranks' files, so "
        "the directory must be one every rank can read"),
    "checkpoint.parallel_write": ("no effect", "a pipeline-parallel setting"),
    "checkpoint.checkpoint_serialization": ("no effect", "DCP writes each rank's pieces itself"),
    "checkpoint.writer": ("no effect", "DeepSpeed's checkpoint writers; zero3 writes with DCP (async_save: in the "
                          "background)"),
    "comms_logger": ("no effect", "DeepSpeed's communication logger"),
    "flops_profiler": ("no effect", "DeepSpeed's profiler; use torch.profiler"),
    "tensorboard": ("no effect", "DeepSpeed's monitor; log from the training loop"),
    "wandb": ("no effect", "DeepSpeed's monitor; log from the training loop"),
    "csv_monitor": ("no effect", "DeepSpeed's monitor; log from the training loop"),
    "memory_breakdown": ("no effect", "engine.state_report() and engine.model_state_bytes() say it"),
    "dump_state": ("no effect", "print(engine.state_report())"),
    "amp": ("off only", "enabled false; use bf16 or fp16 (NVIDIA apex AMP is not offered)"),
    "expert_parallel": (
        "implemented", "expert parallelism (DeepSpeed AutoEP's keys): each MoE layer's experts shared out over "
        "groups of `autoep_size` ranks, tokens sent to their experts' owners ([mixture of experts](moe.md))"),
    "expert_parallel.enabled": ("implemented", "share the experts out"),
    "expert_parallel.autoep_size": (
        "implemented", "ranks per expert-parallel group, inside a node or over whole nodes; it divides every "
        "layer's expert count"),
    "expert_parallel.preset_model": (
        "no effect", "not needed: the experts are found from the model's own expert-parallel plan"),
}


# Every other key's entry (DeepSpeed's other keys, and zero3's own, whose fate is "zero3"), for the
# configuration reference (see [Note: the configuration reference] in reference.py).
CONFIG_KEYS: dict[str, tuple[str, str]] = {
    "train_batch_size": (
        "implemented", "the global batch: micro batch x accumulation steps x world size; null: computed from "
        "the other two (DeepSpeed's arithmetic; any two of the three fix the third)"),
    "train_micro_batch_size_per_gpu": (
        "implemented", "samples per rank per forward and backward; null: from the other two, and 1 when none "
        "of the three is set"),
    "gradient_accumulation_steps": (
        "implemented", "micro-steps per optimizer step: `engine.step()` steps the optimizer at every N-th call, "
        "and `engine.backward` divides the loss by N; null: from the other two, else 1"),
    "gradient_clipping": (
        "implemented", "clip the gradients to this global norm, taken across every rank's shards; 0: no "
        "clipping"),
    "optimizer": (
        "implemented", "`{\"type\": ..., \"params\": {...}}` ([types](#optimizer-types)); null: none, unless "
        "`initialize` gets a client `optimizer=` (not both)"),
    "scheduler": (
        "implemented", "`{\"type\": ..., \"params\": {...}}` ([types](#scheduler-types)), stepped after every "
        "optimizer step but one an fp16 overflow skipped; null: none, unless `initialize` gets `lr_scheduler=` "
        "(a factory called with the engine's optimizer)"),
    "bf16": ("implemented", "bf16 compute: 16-bit shards, gathers and gradients in bf16, fp32 masters"),
    "bf16.enabled": ("implemented", "compute in bf16 (at most one of bf16 and fp16; neither: fp32)"),
    "bf16.auto_cast": (
        "zero3", "true: the engine's forward casts its floating inputs to bf16 (as FSDP2's "
        "`cast_forward_inputs`); false: inputs pass as given, as DeepSpeed does (it never casts in bf16)"),
    "fp16": ("implemented", "fp16 compute with a loss scale, dynamic unless `loss_scale` is set"),
    "fp16.enabled": ("implemented", "compute in fp16"),
    "fp16.auto_cast": (
        "implemented", "true: the engine's forward casts its floating inputs to fp16 (zero3's default, as FSDP2's "
        "`cast_forward_inputs`); false: inputs pass as given (DeepSpeed's default)"),
    "fp16.loss_scale": ("implemented", "0: a dynamic loss scale; above 0: this static scale"),
    "fp16.initial_scale_power": ("implemented", "the dynamic scale starts at 2 to this power"),
    "fp16.loss_scale_window": (
        "implemented", "steps without an overflow after which the dynamic scale doubles"),
    "fp16.hysteresis": (
        "implemented", "the dynamic scale halves at the N-th overflow (each overflow skips its step); the count "
        "starts again when the scale grows"),
    "fp16.min_loss_scale": ("implemented", "the dynamic scale never falls below this"),
    "fp16.consecutive_hysteresis": (
        "implemented", "true: any step without an overflow starts the `hysteresis` count again, so only "
        "consecutive overflows halve the scale"),
    "zero_optimization": ("implemented", "ZeRO's settings; stage 3 only"),
    "zero_optimization.offload_param.device": (
        "implemented", "`cpu`: the 16-bit shards in host memory; `nvme`: up to `max_in_cpu` elements of them in "
        "host memory, the rest in a file; `none`: on the device"),
    "zero_optimization.offload_param.nvme_path": (
        "implemented", "required with `nvme`: an existing, writable directory; each rank writes in a directory "
        "of its own under it"),
    "zero_optimization.offload_param.pin_memory": (
        "implemented", "page-locked host buffers for the copies to a CUDA device; without CUDA a warning"),
    "zero_optimization.offload_param.buffer_count": (
        "implemented", "with `nvme`: shards read ahead of their all-gather"),
    "zero_optimization.offload_param.buffer_size": (
        "no effect", "each shard is read into a buffer of its own size (no line is logged for it)"),
    "zero_optimization.offload_param.max_in_cpu": (
        "implemented", "with `nvme`: shard elements kept in host memory (the persistent parameters first, then "
        "units in model order)"),
    "zero_optimization.offload_optimizer.device": (
        "implemented", "`cpu` (ZeRO-Offload): fp32 masters, optimizer states and reduced gradients in host "
        "memory, the step on the host; `nvme` (ZeRO-Infinity): masters and states in files, stepped through "
        "host windows; `none`: on the device"),
    "zero_optimization.offload_optimizer.nvme_path": (
        "implemented", "required with `nvme`: an existing, writable directory; the files take twice the "
        "optimizer state (two generations)"),
    "zero_optimization.offload_optimizer.pin_memory": (
        "implemented", "page-locked host buffers for the copies to and from a CUDA device; without CUDA a "
        "warning"),
    "zero_optimization.offload_optimizer.buffer_count": (
        "implemented", "with `nvme`: host windows the step rotates sub-groups through (at least 2)"),
    "zero_optimization.offload_optimizer.ratio": (
        "off only", "1.0; below 1 (DeepSpeed's partial offload) is refused on a GPU (`TierConfigError`), and on a "
        "CPU engine logs a warning and offloads the whole state"),
    "zero_optimization.offload_optimizer.pipeline_read": (
        "no effect", "reads of the next sub-groups always overlap the step"),
    "zero_optimization.offload_optimizer.pipeline_write": (
        "no effect", "writes of the last sub-groups always overlap the step"),
    "zero_optimization.offload_optimizer.fast_init": ("no effect", "the tier's files are reserved at build"),
    "zero_optimization.offload_optimizer.super_offload": (
        "implemented", "with `cpu`: each sub-group's host step begins during the backward, as its gradients land, "
        "and is kept or undone at the step, so training is bit-identical to the step after the backward "
        "(docs/offload.md#the-overlapped-host-step); not with Muon or `lean_memory`"),
    "zero_optimization.offload_optimizer.cpuadam_cores_perc": (
        "no effect", "the host step runs on torch's threads (`torch.set_num_threads`)"),
    "zero_optimization.leaf_module.classes": (
        "implemented", "class names (`Block` or `pkg.module.Block`) whose modules are leaves"),
    "zero_optimization.leaf_module.names": ("implemented", "`named_modules()` names of leaf modules"),
    "zero_optimization.leaf_module.name_suffixes": (
        "implemented", "name suffixes: each module whose name ends so is a leaf"),
    "data_types": ("implemented", "DeepSpeed's gradient dtype section"),
    "data_types.grad_accum_dtype": (
        "implemented", "`fp32`, `bf16` or `fp16`: the dtype gradients accumulate in across micro-steps "
        "(`lp_grads`); null: the compute dtype"),
    "aio": (
        "implemented", "the disk I/O of the `nvme` tiers and of `offload_states(device=\"nvme\")`"),
    "aio.block_size": ("implemented", "bytes per read or write request (a multiple of 4096)"),
    "aio.queue_depth": (
        "implemented", "the I/O pool runs `thread_count` x `queue_depth` threads, so that many requests are in "
        "flight"),
    "aio.thread_count": ("implemented", "see `queue_depth`"),
    "aio.single_submit": ("no effect", "libaio's submission detail; requests are always overlapped"),
    "aio.overlap_events": ("no effect", "libaio's submission detail; requests are always overlapped"),
    "aio.use_gds": ("no effect", "GPUDirect Storage is not used; reads and writes go through host memory"),
    "communication_data_type": (
        "implemented", "`fp32`, `bf16` or `fp16`: the dtype gradients are summed across ranks in; null: the "
        "compute dtype"),
    "gradient_predivide_factor": (
        "implemented", "gradients are divided by this before the sum across ranks and by world size / this "
        "after it"),
    "prescale_gradients": (
        "implemented", "true: divide by the world size before the sum (then `gradient_predivide_factor` has "
        "no effect)"),
    "steps_per_print": (
        "implemented", "rank 0 logs DeepSpeed's progress line (lr, grad norm, loss scale, skipped steps) at "
        "INFO every this many optimizer steps; null or `Infinity`: never"),
    "dataloader_drop_last": (
        "implemented", "the DataLoader `initialize(training_data=...)` returns drops a last, short batch"),
    "zero_optimization.lean_memory": (
        "zero3", "true: no resident 16-bit shards for the trained parameters; each unit's gather casts them from "
        "the fp32 masters as it starts (bit-identical to the default), and each gradient shard is made as the "
        "backward reaches it and dropped at the step, so model state between steps is the masters and the "
        "optimizer states; frozen parameters keep their 16-bit shards. Not with "
        "`offload_param` or `offload_optimizer.device: nvme`"),
    "comm_timeout_s": (
        "zero3", "seconds a collective on the engine's groups waits for a peer (a dead or hung rank) before "
        "it raises; null: the default group's timeout (torch's: 30 min on gloo, 10 on NCCL); also the default "
        "group's when `initialize` creates it"),
    "wall_clock_breakdown": (
        "implemented", "adds forward, backward and step times to the `steps_per_print` line"),
    "checkpoint": (
        "implemented", "DeepSpeed's checkpoint section, with zero3's automatic checkpoints "
        "([checkpoints](checkpoints.md#automatic-checkpoints-the-checkpoint-section))"),
    "checkpoint.dir": (
        "zero3", "where automatic checkpoints live and `resume` looks (every rank must read the same files)"),
    "checkpoint.interval_steps": (
        "zero3", "`engine.step()` saves into `dir` after every N-th optimizer step (tag `global_step<N>`); "
        "null: no automatic saves"),
    "checkpoint.async_save": (
        "zero3", "automatic saves write in the background: the step returns once the state is in host memory"),
    "checkpoint.keep_last": (
        "zero3", "automatic saves keep the newest K complete tags (the next save writes over the oldest removed "
        "one's files, kept in `dir/.recycled`); null: all"),
    "fault_tolerance": (
        "zero3", "this torchrun job is one replica group of a torchft job: the replicas' gradient average, each "
        "step's commit and a returning group's recovery from a healthy peer go through torchft "
        "([fault tolerance](fault_tolerance.md))"),
    "fault_tolerance.enabled": ("zero3", "run on torchft (needs `pip install torchft`)"),
    "fault_tolerance.replica_id": (
        "zero3", "this group's name among the replica groups; null: `TORCHFT_REPLICA_ID`"),
    "fault_tolerance.lighthouse": (
        "zero3", "the torchft lighthouse's address (`http://host:29510`); null: `TORCHFT_LIGHTHOUSE`"),
    "fault_tolerance.min_replicas": ("zero3", "replica groups a step needs to commit"),
    "fault_tolerance.timeout_s": (
        "zero3", "seconds torchft's gradient average, commit vote and a recovery's transfer may take"),
    "fault_tolerance.quorum_timeout_s": ("zero3", "seconds a step may wait for its quorum to form"),
    "fault_tolerance.init_sync": (
        "zero3", "the first quorum copies each rank's state from one replica group to the others (torchft's "
        "`init_sync`); false where every group builds the same weights (the same seed)"),
    "fault_tolerance.async_quorum": (
        "zero3", "true: the quorum forms while the forward runs, and a recovering group takes its peer's state "
        "at the step's commit; false: before the forward"),
    "checkpoint.resume": (
        "zero3", "`zero3.initialize` loads the newest complete checkpoint in `dir`, if there is one "
        "(`engine.global_steps` says where it resumed)"),
}

# The `optimizer` section's types: "torch" stands for any other elementwise torch.optim class.
OPTIMIZER_TYPES: dict[str, str] = {
    "Adam": "torch.optim.AdamW (DeepSpeed's Adam decouples weight decay), or torch.optim.Adam with "
            "`adam_w_mode: false`; `torch_adam` has no effect (torch's fused kernel steps it)",
    "AdamW": "torch.optim.AdamW; `adam_w_mode: false` is refused",
    "Lion": "zero3.optim.Lion",
    "Muon": "torch's Muon math for the 2-D hidden matrices (lr `muon_lr`, null: `lr`), AdamW for every other "
            "parameter (lr `adam_lr`, null: `lr`; torch's betas and eps, the same weight decay); each matrix is "
            "orthogonalized once, by the rank that owns it",
    "torch": "the torch.optim class of that name, with its constructor's arguments (checked against them) and "
             "torch's defaults",
}

# The `scheduler` section's types (zero3.step.lr_schedules, DeepSpeed's five).
SCHEDULER_TYPES: dict[str, str] = {
    "LRRangeTest": "the lr grows from `lr_range_test_min_lr` by `lr_range_test_step_rate` times it per "
                   "`lr_range_test_step_size` steps (in whole stairs with `lr_range_test_staircase`), without end",
    "OneCycle": "the lr rises from `cycle_min_lr` to `cycle_max_lr` and falls back (second half: null is the "
                "first's size and stair count), then decays by `decay_lr_rate` per `decay_step_size` steps; "
                "Adam's first beta cycles the other way between the momentum bounds",
    "WarmupLR": "the lr rises from `warmup_min_lr` to `warmup_max_lr` (null: each group's own lr) over "
                "`warmup_num_steps`, logarithmically or linearly, then stays",
    "WarmupDecayLR": "WarmupLR, then a linear decay back to `warmup_min_lr` at `total_num_steps`",
    "WarmupCosineLR": "each group's lr times a ratio rising from `warmup_min_ratio` to 1, then half a cosine "
                      "down to `cos_min_ratio` at `total_num_steps`",
}
