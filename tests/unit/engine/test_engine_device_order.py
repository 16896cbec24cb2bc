"""Device-ordered writes: on a GPU, save_kv_layer and wait_for_save are called when the attention op
*returns* on the CPU, while the kernels that fill that layer's KV may still be queued on the stream.
The adapter passes a ready signal (a CUDA event recorded on the current stream, polled); the engine
never posts a write of a layer before its signal, in every path: layer-wise, what wait_for_save
posts, TP heterogeneous. Here a fake device's signals stand for the events."""

from __future__ import annotations

import numpy as np

from kv_connectors.plan import TokenRange
from kv_connectors.specs import ProducerAddress, RecvSpec, SendSpec, StepMetadata
from tests.unit.engine.engine_harness import P_PORT, Cluster

P_BLOCKS = (1, 2, 3)
D_BLOCKS = (5, 6, 7)
ANY_P = ProducerAddress("", "127.0.0.1", P_PORT)


class FakeDevice:
    """Kernels queued in order; a signal is ready once the kernels queued before it ran."""

    def __init__(self) -> None:
        self.queued = 0
        self.ran = 0

    def signal(self):
        mark = self.queued = self.queued + 1
        return lambda: self.ran >= mark

    def run_all(self) -> None:
        self.ran = self.queued


def _wrap_posts(c: Cluster) -> list[int]:
    """The device's progress (kernels run) at each post P makes."""
    seen: list[int] = []
    post = c.p.transport.post_write

    def recording(*args, **kwargs):
        seen.append(device.ran)
        return post(*args, **kwargs)

    c.p.transport.post_write = recording  # type: ignore[method-assign]
    device = FakeDevice()
    c.device = device  # type: ignore[attr-defined]
    return seen


def _waiting_d(c: Cluster, spec: RecvSpec, nodes=None) -> None:
    for d in nodes or (c.d,):
        d.step(StepMetadata(reqs_to_recv={"d1": spec}))
    c.run(6, nodes=(*(nodes or (c.d,)), c.p))


def _forward(c: Cluster, layers: tuple[str, ...], ready_at_end: bool) -> None:
    """P's forward pass: each layer's hook with its signal, then wait_for_save's."""
    dev = c.device  # type: ignore[attr-defined]
    c.p.engine.before_forward(StepMetadata(reqs_layerwise={"p-req": SendSpec(P_BLOCKS, "t1")}))
    c.p.engine.start_load(None)
    for layer in layers:
        c.p.engine.on_layer_saved(layer, ready=dev.signal())
    c.p.engine.end_of_forward(ready=dev.signal())


def test_no_layer_is_written_before_its_kernels_ran():
    c = Cluster()
    posts = _wrap_posts(c)
    _waiting_d(c, RecvSpec(ANY_P, "t1", D_BLOCKS, ()))
    _forward(c, ("layer.0", "layer.1"), ready_at_end=False)
    c.p.engine.take_results()
    assert posts == [], "a layer was written before the kernels filling it ran"
    c.device.ran = 1  # type: ignore[attr-defined]  # layer 0's kernels ran
    c.run(2, nodes=(c.p,))
    assert posts == [1], posts
    c.device.run_all()  # type: ignore[attr-defined]
    c.run(4)
    assert all(ran >= i + 1 for i, ran in enumerate(posts)), posts
    assert "d1" in c.d.finished_recving and not c.d.failed_recving
    assert all(np.array_equal(c.d.block(d), c.p.block(p)) for p, d in zip(P_BLOCKS, D_BLOCKS))


def test_what_wait_for_save_writes_waits_for_the_end_of_the_forward_pass():
    """No layer hook was called (a batch replayed from a full graph): wait_for_save writes every
    layer, once the forward pass's kernels ran."""
    c = Cluster()
    posts = _wrap_posts(c)
    _waiting_d(c, RecvSpec(ANY_P, "t1", D_BLOCKS, ()))
    _forward(c, (), ready_at_end=False)
    c.run(3, nodes=(c.p,))
    assert posts == [], "written before the forward pass's kernels ran"
    c.device.run_all()  # type: ignore[attr-defined]
    c.run(4)
    assert posts and all(ran == 1 for ran in posts)
    assert "d1" in c.d.finished_recving and not c.d.failed_recving


def test_device_ordering_between_tp_sizes():
    """P at TP 1 writes each of a TP-2 D's ranks its head: neither before the signal."""
    c = Cluster(d_tp=2, heads=2)
    d1 = c.add_rank("kv_consumer", 1, 2, fill=-1.0)
    posts = _wrap_posts(c)
    spec = RecvSpec(ANY_P, "t1", D_BLOCKS, (), tokens=TokenRange(count=len(D_BLOCKS) * 4))
    _waiting_d(c, spec, nodes=(c.d, d1))
    _forward(c, ("layer.0", "layer.1"), ready_at_end=False)
    c.run(3, nodes=(c.p,))
    assert posts == []
    c.device.run_all()  # type: ignore[attr-defined]
    c.run(6, nodes=(c.d, d1, c.p))
    assert len(posts) == 4 and all(ran >= 1 for ran in posts), posts
    assert c.d.recv_reports == ["d1"] and d1.recv_reports == ["d1"]


def test_without_a_signal_writes_post_at_once_as_on_cpu():
    c = Cluster()
    _wrap_posts(c)
    _waiting_d(c, RecvSpec(ANY_P, "t1", D_BLOCKS, ()))
    c.p.step(StepMetadata(reqs_layerwise={"p-req": SendSpec(P_BLOCKS, "t1")}), layers=("layer.0", "layer.1"))
    assert c.p.transport.posted == 2
