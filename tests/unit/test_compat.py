"""DeepSpeed's private symbols the project uses (the pipeline engine's and module's, the engine's
mixed-precision cast) are checked at start-up: an upgrade that removes or changes one fails
loudly, naming it (megatron-core's: tests/distributed/test_cpu_support.py)."""

from __future__ import annotations

import pytest

from megatron_tempnet import compat


def test_the_pinned_deepspeed_has_every_symbol():
    compat.check_deepspeed()


@pytest.mark.parametrize("symbol", ["_exec_backward_pass", "_INSTRUCTION_MAP"])
def test_a_missing_engine_symbol_fails_loudly(monkeypatch, symbol):
    from deepspeed.runtime.pipe.engine import PipelineEngine

    monkeypatch.delattr(PipelineEngine, symbol)
    with pytest.raises(compat.UpstreamError, match=f"PipelineEngine.{symbol} no longer exists"):
        compat.check_deepspeed()


def test_an_instruction_map_without_backward_fails_loudly(monkeypatch):
    from deepspeed.runtime.pipe import schedule
    from deepspeed.runtime.pipe.engine import PipelineEngine

    reduced = {
        k: v for k, v in PipelineEngine._INSTRUCTION_MAP.items() if k is not schedule.SendGrad
    }
    monkeypatch.setattr(PipelineEngine, "_INSTRUCTION_MAP", reduced)
    with pytest.raises(compat.UpstreamError, match="no longer maps schedule.SendGrad"):
        compat.check_deepspeed()


def test_a_fragment_without_its_address_fails_loudly(monkeypatch):
    """The sharded checkpoints read each ZeRO fragment's address and master."""
    from deepspeed.utils.tensor_fragment import tensor_fragment

    fields = {k: v for k, v in tensor_fragment.__dataclass_fields__.items() if k != "hp_fragment"}
    monkeypatch.setattr(tensor_fragment, "__dataclass_fields__", fields)
    with pytest.raises(compat.UpstreamError, match="no longer has lp_fragment_address and hp_"):
        compat.check_deepspeed()


def _init_without_local_start(self, layers):
    self._grid, self.forward_funcs, self.tied_modules = None, [], {}


def _init_without_forward_funcs(self, layers):
    self._grid, self._local_start, self.tied_modules = None, 0, {}


def _init_without_tied_modules(self, layers):
    self._grid, self._local_start, self.forward_funcs = None, 0, []


@pytest.mark.parametrize(
    "attribute,init",
    [
        ("_local_start", _init_without_local_start),
        ("forward_funcs", _init_without_forward_funcs),
        ("tied_modules", _init_without_tied_modules),
    ],
)
def test_a_renamed_module_attribute_fails_loudly(monkeypatch, attribute, init):
    from deepspeed.runtime.pipe.module import PipelineModule

    monkeypatch.setattr(PipelineModule, "__init__", init)  # no longer sets the attribute
    with pytest.raises(compat.UpstreamError, match=f"PipelineModule.{attribute} no longer exists"):
        compat.check_deepspeed()


def test_an_unpinned_deepspeed_fails_loudly(monkeypatch):
    import deepspeed

    monkeypatch.setattr(deepspeed, "__version__", "0.20.0")
    with pytest.raises(compat.UpstreamError, match="DeepSpeed 0.20.0 is installed"):
        compat.check_deepspeed()


def test_a_changed_mixed_precision_cast_fails_loudly(monkeypatch):
    from deepspeed.runtime.engine import DeepSpeedEngine

    monkeypatch.delattr(DeepSpeedEngine, "_cast_module_mixed_precision")
    with pytest.raises(compat.UpstreamError, match="_cast_module_mixed_precision no longer exists"):
        compat.check_deepspeed()
    monkeypatch.setattr(
        DeepSpeedEngine,
        "_cast_module_mixed_precision",
        lambda self, param_dtype: None,
        raising=False,
    )
    with pytest.raises(compat.UpstreamError, match="lost parameter"):
        compat.check_deepspeed()


def test_an_engine_that_casts_elsewhere_fails_loudly(monkeypatch):
    from deepspeed.runtime.engine import DeepSpeedEngine

    def configure_without_the_cast(self, model):
        self.module = model

    monkeypatch.setattr(DeepSpeedEngine, "_configure_distributed_model", configure_without_the_cast)
    with pytest.raises(compat.UpstreamError, match="no longer casts the model"):
        compat.check_deepspeed()
