def choose_layout(job: dict) -> dict:
    """A layout for ``job``, as a dict for ``lab.plan(parallel=...)``: tp, pp, zero, sequence_parallel,
    activation_checkpointing (dp is the GPUs left over). It must fit job['gpu_mem_gb'] per GPU by the
    planner's memory prediction, use all job['gpus'] GPUs, and step within STEP_BUDGET_S by its estimate."""
    ### BEGIN SOLUTION
    fitting = []  # (estimated step in s, layout) of every candidate that fits the budget
    for tp in (1, 2, 4, 8):  # inside one node of 8 GPUs; each divides Llama-3 70B's 64 heads
        for pp in (1, 2, 4, 8):  # each divides the 80 layers
            if job['gpus'] % (tp * pp):
                continue
            for zero in (1, 3):
                for sequence_parallel in {False, tp > 1}:  # SP splits activations over the TP group
                    for activation_checkpointing in (False, True):  # recompute: less memory, 1/3 more FLOPs
                        layout = dict(tp=tp, pp=pp, zero=zero, sequence_parallel=sequence_parallel,
                                      activation_checkpointing=activation_checkpointing)
                        plan = lab.plan(parallel=layout, **job)
                        if plan.fits:
                            fitting.append((plan.step.total_s, layout))
    return min(fitting, key=lambda pair: pair[0])[1]
    ### END SOLUTION
