"""Registration with vLLM's connector factory: entry point present, idempotent, both loading forms resolve."""

from importlib.metadata import entry_points

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

from kv_connectors import plugin
from kv_connectors.nixl import NixlConnector


def test_entry_point_is_installed():
    eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.value.startswith("kv_connectors.")]
    assert [ep.value for ep in eps] == ["kv_connectors.plugin:register"]


def test_register_is_idempotent_and_resolves_our_class():
    plugin.register()
    plugin.register()  # a second call in the same process must not raise
    assert KVConnectorFactory.get_connector_class_by_name("KvcNixlConnector") is NixlConnector
    # vLLM's own names stay vLLM's.
    assert KVConnectorFactory.get_connector_class_by_name("NixlConnector") is not NixlConnector


def test_module_path_form_loads_our_class_despite_the_builtin_name():
    cfg = KVTransferConfig(kv_connector="NixlConnector", kv_connector_module_path="kv_connectors.nixl", kv_role="kv_producer")
    assert KVConnectorFactory.get_connector_class(cfg) is NixlConnector
    from kv_connectors.mooncake import MooncakeConnector

    cfg = KVTransferConfig(
        kv_connector="MooncakeConnector", kv_connector_module_path="kv_connectors.mooncake", kv_role="kv_producer"
    )
    assert KVConnectorFactory.get_connector_class(cfg) is MooncakeConnector
    assert MooncakeConnector.default_extra_config == {"mode": "push"}
    cfg = KVTransferConfig(kv_connector="KvcNixlConnector", kv_role="kv_consumer")
    plugin.register()
    assert KVConnectorFactory.get_connector_class(cfg) is NixlConnector


def test_pipeline_parallelism_is_refused_at_start_up():
    """PP > 1 would read another stage's layers: refused with a clear error, never served. TP is
    served rank to rank (tests/unit/engine/test_engine_tp.py)."""
    from types import SimpleNamespace

    import pytest

    from kv_connectors.errors import ConfigError
    from kv_connectors.vllm.compat import KVConnectorRole

    for tp, pp in ((1, 2), (2, 2)):
        cfg = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp))
        with pytest.raises(ConfigError, match="pipeline_parallel_size 1 only"):
            NixlConnector(cfg, KVConnectorRole.WORKER, None)
