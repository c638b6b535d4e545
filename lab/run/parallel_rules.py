"""``RULES``: every named rule a layout, an experiment or a model can break, with what it asks, in words.

The keys are the names errors carry (``[world-size]``); ``lab.Parallel``, ``lab.Experiment``, ``RunConfig``
and the model configs raise them through ``kernels.contract`` (the rules themselves live there, torch-free,
so the ranks apply the same ones). Tests check that every rule has a case that breaks it.
"""
RULES = {
    "mesh-order": "mesh_order names pp, dp and tp once each, outermost first",
    # The fields one at a time (kernels.contract.config_rules): Parallel, Experiment, RunConfig and GPTConfig.
    "positive-sizes": "sizes and counts (dp, tp, pp, microbatches, stages_per_rank, dp_replicate, global_batch, "
                      "steps, the model's layers, d_model, heads, vocab, seq_len, d_ff) must be ints >= 1, "
                      "not bools, floats or strings",
    "bool-flags": "switches (sequence_parallel, loss_parallel, cpu_offload, trace, "
                  "measure, compile, the model's bias) must be True or False, not 1 or 'yes'",
    "adamw": "AdamW needs a finite lr > 0, eps > 0, weight_decay >= 0 and betas two numbers in [0, 1)",
    "seed": "seeds must be ints in [0, 2**64), the range torch.Generator.manual_seed takes",
    "model-keys": "the model's fields are GPTConfig's (layers, d_model, heads, vocab, seq_len, d_ff, bias) or, for "
                  "lab.Llama, Llama 3's (layers, hidden, heads, kv_heads, ffn, vocab, seq_len, rope_theta, norm_eps), "
                  "and in both the mixture of experts' (experts, top_k, capacity_factor, aux_loss_coef)",
    "heads-d-model": "d_model (a Llama's hidden) must be divisible by heads, and a Llama's heads by kv_heads",
    "moe-experts": "experts is an int >= 0 (0: the dense MLP)",
    "moe-top-k": "top_k is an int >= 1, and at most experts when the model has experts",
    "moe-capacity": "capacity_factor is None (dropless) or a finite number > 0",
    "moe-aux-loss": "aux_loss_coef is a finite number >= 0",
    "moe-sp": "sequence_parallel with experts is not built: tp splits the attention and keeps the experts whole",
    "data-vocab": "the data's token ids must fit the model's vocab (the synthetic chain needs vocab >= 4: every "
                  "token has 4 distinct successors; bytes need the largest byte; modular addition mod p needs p + 2)",
    "data": "data= is None, lab.Text, lab.Tokens, lab.ModularAddition or lab.Batches (a path, a list of paths, "
            "a 1-D tensor of ids, a datasets.Dataset or an iterable of batches stand for them), with the fields "
            "its kind needs",
    "data-file": "the data's files exist where the ranks read them and hold text, or 1-D integer token ids",
    "data-length": "the data holds at least one sequence: seq_len + 1 tokens (your own batches: one per step)",
    "data-batch": "each of your own batches holds global_batch sequences",
    # A model the user brought (kernels.contract.model_rules, lab.run.own_models).
    "model-build": "the model builds from its factory or its Hugging Face config (transformers installed)",
    "model-pickle": "a lab.Model's factory and loss can be pickled (by value), so every rank can build it",
    "tp-plan": "tp > 1 needs a tensor-parallel plan whose every entry names a module (or parameter) of the model",
    "tp-style": "every style in the plan is one the lab applies (kernels.contract.model_rules.TP_STYLES)",
    "tp-width": "tp must divide each width the tensor-parallel plan splits",
    "measure-on-size": "lab.plan(..., measure_on=pool) runs the layout's tp and pp on the pool: tp*pp must divide "
                       "its ranks",
    "tp-sp-model": "sequence_parallel needs blocks of norms and column- then row-split regions, then norms and a head",
    "pp-blocks": "pp > 1 needs the model's block list: blocks= names a non-empty nn.ModuleList",
    "trace-pipeline": "trace=True times pipeline actions, so it needs pp > 1",
    "synthetic-cost": "synthetic_forward_s is a finite number of seconds > 0, and needs trace=True",
    "optimizer": "the optimizer must be one of kernels.contract.config_rules.OPTIMIZERS: adamw or sgd",
    "argument-types": "an Experiment's model is a lab.GPT, a lab.Llama, a Hugging Face config or a lab.Model, "
                      "and its parallel a lab.Parallel",
    "model-seed": "the Experiment's seed fixes the weights: lab.GPT's seed must be left at 0 or equal it",
    "checkpoint": "checkpoint_dir and resume_from are path strings, checkpoint_every an int >= 1; checkpoint_every "
                  "and checkpoint_async need checkpoint_dir; a resume needs steps beyond the checkpoint's step",
    "checkpoint-dir": "checkpoint_dir must be a directory this process can create and write into",
    "faults": "faults is a list of lab.Slow/Hang/Crash/Kill on ranks of the pool, at steps the run takes, and "
              "lab.PoisonBatch at such a step (kind 'nan' or 'spike', scale > 1)",
    "hang-after": "hang_after is None or a number of seconds > 0",
    "watch": "hang_after and faults need watch=True: the rank's watch publishes and strikes them",
    # Training hygiene (kernels.contract.training_hygiene, lab.run.training_hygiene).
    "grad-clip": "grad_clip is None or a finite number > 0: the global L2 norm of the gradient each step may apply",
    "lr-schedule": "lr_schedule is None, lab.WarmupCosine (total_steps > warmup_steps >= 0, min_factor in [0, 1]), "
                   "lab.StepLR (step_size >= 1, gamma > 0) or a picklable function step -> finite factor >= 0",
    "shuffle": "shuffle is None (the data's own order), or True/False for text and token ids (False also for your "
               "own batches): the synthetic chain and tasks draw each batch afresh, with no epochs",
    "spike-guard": "spike_guard is None or a lab.SpikeGuard with factor > 1, window >= 1 and action 'skip' "
                   "(rollback to the last checkpoint is not built)",
    "auto-resume": "lab.Training's auto_resume is True or False, and True needs checkpoint_dir and checkpoint_every "
                   "(it goes back to the last complete checkpoint)",
    "on-event": "on_event is None, a callable taking a lab.RunEvent, or an http(s) URL to post each event to as JSON",
    "log-to": "log_to is 'tensorboard:DIR' or 'wandb', with that package installed",
    # A parameter server's arguments (lab.ParameterServer).
    "ps-servers": "servers is an int from 1 to world_size-1: at least one rank must be a worker",
    "ps-mode": "mode is 'sync', 'async' or 'bounded'",
    "ps-max-staleness": "max_staleness is an int >= 0 for mode 'bounded', and None otherwise",
    "ps-faults": "faults act on workers, not on server ranks",
    # The layout, and the layout against the model and the world.
    "world-size": "dp * cp * tp * pp must equal the world size",
    "ep-dp": "ep must divide dp: the experts are split over groups of ep data-parallel ranks",
    "ep-experts": "ep needs a model with experts (lab.GPT(..., experts=E), or a Hugging Face MoE config), and E must "
                  "be divisible by ep",
    "ep-plan": "ep on a model the user brought splits the experts modules its config's base_model_ep_plan names, "
               "each with transformers' forward(hidden_states, top_k_index, top_k_weights)",
    "ep-combination": "expert parallelism runs beside data parallelism only (not with tp, pp or cp)",
    "ep-sharding": "with ep, the dense parts use DDP (zero 0) or FSDP2 (zero 2/3), not zero 1/hybrid/no_shard/offload",
    "cp-chunks": "seq_len must be divisible by 2 * cp: each cp rank holds two chunks, one from each end",
    "cp-combination": "context parallelism runs beside dp, ZeRO/FSDP, tp and pp, not with sequence_parallel",
    "cp-model": "context parallelism runs on lab.GPT and lab.Llama only: the lab swaps the attention of its own models",
    "tp-heads": "the number of heads must be divisible by tp",
    "tp-d-model": "d_model must be divisible by tp",
    "tp-d-ff": "d_ff must be divisible by tp",
    "tp-kv-heads": "a Llama's kv_heads must be divisible by tp: each rank keeps whole key/value heads",
    "tp-ffn": "a Llama's ffn (its MLP width) must be divisible by tp",
    "tp-vocab": "vocab must be divisible by tp: the token embedding and the LM head are split over the vocab",
    "tp-seq-len": "seq_len must be divisible by tp: the position table is split over positions "
                  "(and sequence parallel splits the sequence)",
    "loss-parallel-pp": "loss_parallel needs pp == 1: a pipeline schedule computes the loss inside its last stage",
    "pp-layers": "layers must be divisible by the number of stages pp * stages_per_rank (or stage_layers given)",
    "stage-layers": "stage_layers is None or, with pp > 1, a list of ints >= 1: each pipeline stage's blocks, one "
                    "entry per stage (pp * stages_per_rank), in stage order",
    "stage-layers-sum": "stage_layers must add up to the model's layers: every block on exactly one stage",
    "pp-microbatches": "microbatches must be at least pp (gpipe with 1 is naive model parallelism)",
    "unknown-schedule": "the schedule must be one of SCHEDULES",
    "single-stage-schedule": "gpipe and 1f1b run exactly one stage per rank (stages_per_rank == 1)",
    "1f1b-microbatches": "Schedule1F1B needs microbatches >= the number of stages",
    "interleaved-stages-per-rank": "interleaved schedules need stages_per_rank >= 2",
    "interleaved-rounds": "interleaved schedules need microbatches % max(1, microbatches // pp) == 0",
    "v-schedule-stages": "zbv and dualpipev need exactly 2 stages per rank (stages_per_rank == 2)",
    "dualpipev-microbatches": "DualPipeV needs microbatches >= the number of stages",
    "global-batch": "global_batch must be divisible by dp * microbatches",
    "zero-stage": "zero must be 0, 1, 2 or 3",
    "fsdp-strategy": "fsdp_strategy must be None or one of FSDP_STRATEGIES",
    "zero-fsdp-agree": "zero and fsdp_strategy given together must agree (2: grad_op, 3: full)",
    "hybrid-dp": "hybrid sharding needs dp >= 2 to split into replicate x shard",
    "dp-replicate": "dp_replicate is for fsdp_strategy 'hybrid' only, and must divide dp",
    "mixed-precision": "mixed_precision must be None or 'bf16'",
    "activation-checkpointing": "activation_checkpointing must be False, True (recompute each block in backward) "
                                "or 'selective' (recompute all but the matmuls and collectives)",
    "cpu-offload": "cpu_offload needs full sharding (zero 3 / FSDP full or hybrid)",
    "reshard-after-forward": "reshard_after_forward is None (from zero), True or False, or a dict from the FSDP "
                             "units 'root' and 'blocks' to True/False",
    "reshard-fsdp": "reshard_after_forward needs FSDP2 sharding: zero 2 or 3 (fsdp_strategy grad_op, full or hybrid)",
    "zero3-split-backward": "ZeRO-3 (FSDP2 resharding after forward, for any unit) gives wrong gradients under the "
                            "split-backward schedules interleaved_zero_bubble, zbv and dualpipev; use zero 2 there",
}
