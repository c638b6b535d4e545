import torch
import torch.distributed as dist


def mean_allreduce_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP calls this on every rank, during backward, once all the gradients in ``bucket`` are ready.

    ``bucket.buffer()``: the bucket's gradients as one flat fp32 tensor, (numel,), this rank's own.
    ``state``: the process group to average over (None: the default group of all ranks).
    Return a Future whose value is that tensor averaged over the ranks. Start the all-reduce without
    waiting for it, so that backward goes on computing the next bucket's gradients meanwhile.
    """
    ### BEGIN SOLUTION
    group = state if state is not None else dist.group.WORLD
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)  # SUM over the ranks, in place
    return work.get_future().then(lambda fut: fut.value()[0] / dist.get_world_size(group))
    ### END SOLUTION
