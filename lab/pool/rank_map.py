"""The rank map: which engine becomes which rank, on which device, with which backend.

Pure functions over ``EngineInfo`` records (no I/O, no torch), so the driver can check a
world before any process group exists. The rule (docs/design.md#rank-map):

* engines are grouped by host, hosts ordered by the lowest engine id on each, and ranks
  are numbered host by host; inside a host local_rank is 0..k-1 in engine-id order;
* if every engine on a host sees the same GPU list (``CUDA_VISIBLE_DEVICES`` entries, maybe
  ``("2", "3")`` or UUIDs), local rank i takes ``cuda:i`` = list[i]; if they see different
  lists (per-engine binding, e.g. Slurm's one GPU per task), each takes ``cuda:0`` = its own
  first GPU, and those must differ across the host;
* the backend is ``nccl`` only when that gives every rank its own GPU, else ``gloo`` on CPU,
  and the map's ``note`` says why;
* with ``share_gpu=True`` and fewer GPUs than ranks, the ranks stay on gloo but compute on
  the GPUs, local rank i on the host's GPU i mod g (NCCL refuses two ranks on one GPU, while
  gloo runs the collectives DDP, FSDP2 and DTensor need on CUDA tensors).
"""
from __future__ import annotations

from collections.abc import Sequence

from kernels.contract.pool_records import EngineInfo, RankInfo, RankMap

BACKENDS = ("auto", "nccl", "gloo")

# (device, physical gpu id) per engine of one host, in local_rank order.
Placement = list[tuple[str, "str | None"]]


class RankMapError(ValueError):
    """An engine set that cannot form the requested world; the message names the
    constraint, the host(s) and the numbers involved."""


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def group_by_host(engines: Sequence[EngineInfo]) -> dict[str, list[EngineInfo]]:
    """Host -> its engines by engine id; hosts ordered by the lowest engine id on each."""
    out: dict[str, list[EngineInfo]] = {}
    for e in sorted(engines, key=lambda e: e.engine_id):
        out.setdefault(e.host, []).append(e)  # first insertion = lowest id on that host
    return out


def _place_shared(host: str, engs: list[EngineInfo]) -> Placement | str:
    """All engines see one list: local rank i -> ``cuda:i``. Returns a problem string if short."""
    gpus, k = engs[0].gpus, len(engs)
    distinct = len(set(gpus))
    if len(set(gpus[:k])) < k:  # too few, or a repeated id among the first k
        seen = ", ".join(repr(g) for g in gpus) or "none"
        return (f"host {host!r} has {_plural(distinct, 'GPU')} ({seen}) for {k} ranks "
                f"(engines {', '.join(str(e.engine_id) for e in engs)})")
    return [(f"cuda:{i}", gpus[i]) for i in range(k)]


def _place_per_engine(host: str, engs: list[EngineInfo]) -> Placement | str:
    """Engines see different lists: each takes ``cuda:0`` = its own first GPU, all distinct."""
    k = len(engs)
    owner: dict[str, int] = {}
    blind: list[int] = []
    shared: list[str] = []
    for e in engs:
        if not e.gpus:
            blind.append(e.engine_id)
        elif e.gpus[0] in owner:
            shared.append(f"engines {owner[e.gpus[0]]} and {e.engine_id} share GPU {e.gpus[0]!r}")
        else:
            owner[e.gpus[0]] = e.engine_id
    if not blind and not shared:
        return [("cuda:0", e.gpus[0]) for e in engs]
    if blind:
        ids = ", ".join(map(str, blind))
        shared.append(f"engine {ids} sees no GPU" if len(blind) == 1
                      else f"engines {ids} see no GPU")
    why = shared
    return f"host {host!r} has {_plural(len(owner), 'GPU')} for {k} ranks ({'; '.join(why)})"


def place_host(host: str, engs: list[EngineInfo]) -> Placement | str:
    """(device, gpu) for each engine of one host in order, or why it has no GPU per rank."""
    if len({e.gpus for e in engs}) == 1:
        return _place_shared(host, engs)
    return _place_per_engine(host, engs)


def _check_engines(engines: Sequence[EngineInfo], backend: str) -> None:
    if backend not in BACKENDS:
        raise RankMapError(f"unknown backend {backend!r}: allowed are {', '.join(BACKENDS)}")
    if not engines:
        raise RankMapError("no engines: a rank map needs at least 1 engine, got 0")
    ids = [e.engine_id for e in engines]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise RankMapError(f"engine ids must be unique: {dup} appear more than once "
                           f"among {len(ids)} engines")


def _check_equal_hosts(hosts: dict[str, list[EngineInfo]]) -> None:
    counts = {h: len(engs) for h, engs in hosts.items()}
    if len(set(counts.values())) > 1:
        each = ", ".join(f"{h!r}: {n}" for h, n in counts.items())
        raise RankMapError("a mesh with a per-host axis needs the same number of ranks on "
                           f"every host; ranks per host are {each}")


def _choose_backend(backend: str, plans: dict[str, Placement | str],
                    engines: Sequence[EngineInfo]) -> tuple[str, str]:
    """Return (backend, note) from the request and each host's placement."""
    problems = [p for p in plans.values() if isinstance(p, str)]
    if backend == "gloo":
        return "gloo", "gloo requested: CPU ranks"
    if problems and backend == "nccl":
        raise RankMapError("backend 'nccl' needs one GPU per rank: " + "; ".join(problems))
    if not problems:
        each = "the rank has" if len(engines) == 1 else f"each of {len(engines)} ranks has"
        return "nccl", f"nccl: {each} its own GPU on {_plural(len(plans), 'host')}"
    if not any(e.gpus for e in engines):
        return "gloo", "no GPUs visible: CPU ranks with gloo"
    return "gloo", ("; ".join(problems) + ": using gloo on CPU; NCCL needs one GPU per rank "
                    "(share_gpu=True puts the ranks on the GPUs with gloo instead)")


def _share_gpus(hosts: dict[str, list[EngineInfo]]) -> tuple[dict[str, Placement], str] | None:
    """(placement per host, note): each host's ranks round robin over the GPUs it sees; None where a host sees none."""
    plans: dict[str, Placement] = {}
    counts = []
    for host, engs in hosts.items():
        if not all(e.gpus for e in engs):
            return None
        if len({e.gpus for e in engs}) == 1:  # one list for all: local rank i -> GPU i mod g
            gpus = list(dict.fromkeys(engs[0].gpus))
            plans[host] = [(f"cuda:{i % len(gpus)}", gpus[i % len(gpus)]) for i in range(len(engs))]
        else:  # per-engine binding: each keeps its own first GPU, maybe the same as a neighbour's
            gpus = list(dict.fromkeys(e.gpus[0] for e in engs))
            plans[host] = [("cuda:0", e.gpus[0]) for e in engs]
        counts.append(f"{_plural(len(engs), 'rank')} on {_plural(len(gpus), 'GPU')} of host {host!r}")
    note = ("gloo with CUDA tensors, GPUs shared: " + ", ".join(counts) + ". Ranks on one GPU take turns "
            "on it, so step times include that contention and are no per-GPU speed")
    return plans, note


def build_rank_map(engines: Sequence[EngineInfo], backend: str = "auto", *, share_gpu: bool = False,
                   require_equal_hosts: bool = False) -> RankMap:
    """Turn the engines' reports into the world's rank map.

    ``backend`` is "auto" (nccl when every rank has its own GPU, else gloo on CPU),
    "nccl" (raise RankMapError when some rank has no GPU of its own) or "gloo" (CPU ranks).
    ``share_gpu`` lets gloo ranks compute on GPUs when there are fewer GPUs than ranks (with
    "auto" or "gloo"; with no GPU visible the ranks stay on the CPU and the note says so).
    ``require_equal_hosts`` raises when hosts have different rank counts, as a mesh with a
    per-host axis (e.g. HSDP's replicate axis) needs.
    """
    _check_engines(engines, backend)
    if share_gpu and backend == "nccl":
        raise RankMapError("share_gpu=True runs gloo: NCCL refuses two ranks on one GPU "
                           "('Duplicate GPU detected'); use backend 'auto' or 'gloo'")
    hosts = group_by_host(engines)
    if require_equal_hosts:
        _check_equal_hosts(hosts)
    plans = {h: place_host(h, engs) for h, engs in hosts.items()}
    chosen, note = _choose_backend(backend, plans, engines)
    if chosen == "gloo":  # CPU ranks, unless they may share the GPUs
        shared = _share_gpus(hosts) if share_gpu else None
        if shared is not None:
            plans, note = shared
        else:
            plans = {h: [("cpu", None)] * len(engs) for h, engs in hosts.items()}
            note += "; share_gpu=True has no GPU to share on some host" if share_gpu else ""
    ranks: list[RankInfo] = []
    for host, engs in hosts.items():
        for local_rank, (e, (device, gpu)) in enumerate(zip(engs, plans[host])):
            ranks.append(RankInfo(rank=len(ranks), local_rank=local_rank, engine_id=e.engine_id,
                                  host=host, ip=e.ip, pid=e.pid, device=device, gpu=gpu,
                                  backend=chosen))
    return RankMap(ranks=tuple(ranks), backend=chosen, master_addr=ranks[0].ip, note=note)


def local_world_sizes(rank_map: RankMap) -> dict[str, int]:
    """Host -> number of ranks on it (LOCAL_WORLD_SIZE), hosts in rank order."""
    return {h: len(rs) for h, rs in rank_map.hosts().items()}
