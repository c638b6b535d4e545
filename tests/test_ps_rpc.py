"""The parameter server's RPC plumbing on one process: restarts after an interrupted stop, and failed replies."""
import time

import pytest
import torch.distributed.rpc as rpc
import torch.distributed.rpc.api as rpc_api

from torch.futures import Future

from kernels.ps import ps_rpc


def _start_alone() -> None:
    port = ps_rpc.open_rpc_store("127.0.0.1", 1, 30)
    ps_rpc.start_rpc(0, 1, "127.0.0.1", port, "127.0.0.1", 30)


def _echo(text: str) -> str:
    return text


def test_an_agent_left_set_by_an_interrupted_run_is_replaced_at_the_next_start():
    _start_alone()
    # the interrupted run: it never reached stop_rpc
    _start_alone()
    assert rpc.rpc_sync(ps_rpc.rpc_name(0), _echo, args=("again",)) == "again"
    # interrupted inside rpc.shutdown: the agent stopped, but it is still the current one
    rpc_api._get_current_rpc_agent().shutdown()
    assert rpc_api._is_current_rpc_agent_set()
    _start_alone()
    assert rpc.rpc_sync(ps_rpc.rpc_name(0), _echo, args=("once more",)) == "once more"
    ps_rpc.stop_rpc(graceful=False)
    assert not rpc_api._is_current_rpc_agent_set()
    ps_rpc.stop_rpc(graceful=False)  # without an agent: nothing to do


_held: list[Future] = []


@rpc.functions.async_execution
def _fails_at_once() -> Future:
    failed: Future = Future()
    failed.set_exception(RuntimeError("server stopped at once"))
    return failed


@rpc.functions.async_execution
def _fails_later() -> Future:
    _held.append(Future())
    return _held[-1]


def test_wait_raises_what_an_async_execution_call_failed_with():
    # torch hands such a failure back as the exception object, returned; a worker must not take it for a version
    _start_alone()
    try:
        with pytest.raises(RuntimeError, match="at once"):
            ps_rpc.wait(rpc.rpc_async(ps_rpc.rpc_name(0), _fails_at_once))
        call = rpc.rpc_async(ps_rpc.rpc_name(0), _fails_later)
        while not _held:
            time.sleep(0.01)
        _held[0].set_exception(RuntimeError("server stopped while holding the push"))
        with pytest.raises(RuntimeError, match="while holding"):
            ps_rpc.wait(call)
        assert ps_rpc.wait(rpc.rpc_async(ps_rpc.rpc_name(0), _echo, args=("fine",))) == "fine"
    finally:
        ps_rpc.stop_rpc(graceful=False)
