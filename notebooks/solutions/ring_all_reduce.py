%%px
def ring_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over all ranks in place, as a ring: n-1 reduce-scatter steps, then n-1 all-gather steps."""
    chunks = list(torch.tensor_split(x, world))  # n views of x, lengths differing by at most one
    right, left = (rank + 1) % world, (rank - 1) % world
    ### BEGIN SOLUTION
    for step in range(world - 1):  # reduce-scatter: rank r ends with the whole sum of chunk r
        mine, theirs = (rank - step - 1) % world, (rank - step - 2) % world
        incoming = torch.empty_like(chunks[theirs])
        sending = dist.isend(chunks[mine], right)  # returns at once, so every rank reaches its recv
        dist.recv(incoming, left)
        sending.wait()
        chunks[theirs] += incoming  # in place: the chunks are views of x
    for step in range(world - 1):  # all-gather: pass each finished chunk on round the ring
        sending = dist.isend(chunks[(rank - step) % world], right)
        dist.recv(chunks[(rank - step - 1) % world], left)  # straight into place
        sending.wait()
    ### END SOLUTION
    return x
