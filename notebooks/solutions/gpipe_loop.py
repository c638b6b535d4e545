import torch.distributed as dist


def gpipe_step(module, stage, peer, microbatches):
    """One GPipe step on this rank: every micro-batch's forward, then every backward (Huang et al. 2019).

    Stage 0 runs ``module`` on each input and sends the activation, (b, HIDDEN), to ``peer``; stage 1 receives
    it, takes the loss (F.mse_loss(...) / m) and sends the activation's gradient back. Gradients accumulate in
    ``module``'s parameters. Returns the step's loss (the sum of the m scaled losses) on stage 1, None on stage 0.
    """
    m = len(microbatches)
    ### BEGIN SOLUTION
    kept, sends, loss = [], [], None  # what each backward needs; the sends in flight (their buffers must live)
    for x, y in microbatches:  # all forwards
        if stage == 0:
            out = module(x)  # (b, HIDDEN)
            sends.append(dist.isend(out.detach(), peer))  # the activation, forward
            kept.append(out)
        else:
            act = torch.empty(x.shape[0], HIDDEN, device=x.device)
            dist.irecv(act, peer).wait()
            act.requires_grad_()  # a leaf here: backward leaves dloss/dact in act.grad
            kept.append((act, F.mse_loss(module(act), y) / m))
    for i in range(m):  # all backwards
        if stage == 1:
            act, part = kept[i]
            part.backward()
            sends.append(dist.isend(act.grad, peer))  # the activation's gradient, backward
            loss = part.detach() if loss is None else loss + part.detach()
        else:
            grad = torch.empty_like(kept[i])
            dist.irecv(grad, peer).wait()
            kept[i].backward(grad)  # the chain rule goes on from stage 1 into this stage's weights
    for request in sends:
        request.wait()
    return loss
    ### END SOLUTION
