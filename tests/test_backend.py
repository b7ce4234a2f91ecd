"""runtime/backend.py, the one place that picks the model: the plain GPT off CUDA and with --kernels=0, FastGPT
with the kernels; a clear error, not a quiet fallback, where kernels are asked for and cannot run; the plain model,
with a note, on a Triton the kernels were not tested with."""
import builtins
import sys

import pytest
import torch

from model.config import GPTConfig
from model.gpt import GPT
from runtime import backend
from runtime.errors import UserError

TINY = GPTConfig(vocab_size=256, num_layers=2, model_dim=64, num_heads=2, head_dim=32, num_value_embeds=1, bos_id=0)
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_the_cpu_gets_the_plain_model_configured_for_it():
    model, notes = backend.build_model(TINY, CPU)
    assert type(model) is GPT and notes == []
    assert (model.attention_backend, model.compute_dtype) == ("sdpa", torch.float32)
    assert backend.build_model(TINY, CPU, kernels="0")[0].attention_backend == "sdpa"


def test_kernels_asked_for_off_cuda_are_refused():
    with pytest.raises(UserError, match=r"--kernels=1: the fused kernels run on CUDA GPUs, and this run is on cpu; "
                                        r"drop --kernels \(auto\) or pass --kernels=0"):
        backend.build_model(TINY, CPU, kernels="1")


def test_kernels_that_cannot_load_on_cuda_are_an_error_not_a_fallback(monkeypatch):
    real_import = builtins.__import__

    def no_triton(name, *args, **kwargs):
        if name.startswith("model.fast") or name == "triton":
            raise ImportError("No module named 'triton'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(backend, "untested_triton", lambda: None)
    monkeypatch.delitem(sys.modules, "model.fast.gpt", raising=False)
    monkeypatch.setattr(builtins, "__import__", no_triton)
    with pytest.raises(UserError, match=r"the fused kernels \(model/fast\) could not load \(No module named 'triton'\); "
                                        r"install the tested pair .* or pass --kernels=0"):
        backend.build_model(TINY, CUDA, kernels="auto")


@pytest.mark.parametrize("installed, untested", [("3.6.0", None), ("3.8.1", None), ("3.9.0", "3.9.0"),
                                                 (None, None)])
def test_an_untested_triton_trains_the_plain_model_with_a_note(monkeypatch, installed, untested):
    def version(name):
        if installed is None:
            raise backend.PackageNotFoundError(name)
        return installed

    monkeypatch.setattr(backend, "version", version)
    assert backend.untested_triton() == untested
    if untested:
        monkeypatch.setattr(GPT, "to", lambda self, device: self)  # no GPU here: build it where it is
        model, notes = backend.build_model(TINY, CUDA, fp8=False)
        assert type(model) is GPT
        assert notes == [f"note: triton {untested} is not one the fused kernels are tested with (3.6, 3.8): "
                         f"training the plain model; --kernels=1 uses the kernels anyway"]


@pytest.mark.parametrize("device, capability, kernels, head_dim, says", [
    (CPU, None, "auto", 32, "this run has cpu and --kernels=auto"),
    (CUDA, (8, 0), "auto", 32, r"this run has compute capability \(8, 0\) and --kernels=auto"),
    (CUDA, (9, 0), "0", 32, r"this run has compute capability \(9, 0\) and --kernels=0"),
    (CUDA, (9, 0), "auto", 48, "needs a power-of-two head_dim of at least 16"),
])
def test_int8_attention_where_it_cannot_run_is_refused(monkeypatch, device, capability, kernels, head_dim, says):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability)
    config = GPTConfig(vocab_size=256, num_layers=2, model_dim=96, num_heads=2, head_dim=head_dim, num_value_embeds=1,
                       bos_id=0)
    with pytest.raises(UserError, match=f"--attention_forward=int8 .*{says}.*use --attention_forward=bf16"):
        backend.build_model(config, device, kernels=kernels, attention_forward="int8")


def test_int8_attention_on_an_untested_triton_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    monkeypatch.setattr(backend, "untested_triton", lambda: "3.9.0")
    with pytest.raises(UserError, match=r"--attention_forward=int8 runs in the fused kernels, which triton 3.9.0 is not "
                                        r"tested with: pass --kernels=1 to use them anyway, or --attention_forward=bf16"):
        backend.build_model(TINY, CUDA, attention_forward="int8")
