"""Layer 1: --model gpt, --model package.module:factory, and the task the data chooses."""

import math
import sys
import textwrap

import pytest
import torch

from hsgd import InputError
from hsgd._trainer.factory import build_from_factory, load_factory
from hsgd._trainer.gpt import GPT
from hsgd._trainer.models import GPTConfig, build_model
from hsgd._trainer.tasks import Classification, LanguageModelling, choose_task

SMALL = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32)


# ---- gpt --------------------------------------------------------------------

def test_gpt_maps_tokens_to_logits_at_every_position():
    torch.manual_seed(0)
    model = build_model("gpt", (64,), 256, gpt=SMALL)
    assert isinstance(model, GPT) and model.pos.num_embeddings == 32
    for length in (32, 7):
        assert model(torch.randint(0, 256, (3, length))).shape == (3, length, 256)
    with pytest.raises(ValueError, match="longer than block_size 32"):
        model(torch.randint(0, 256, (1, 33)))


def test_gpt_is_causal():
    """Changing the tokens from position 20 on changes no output before position 20."""
    torch.manual_seed(0)
    model = build_model("gpt", (32,), 256, gpt=SMALL).eval()
    x = torch.randint(0, 256, (4, 32))
    later = x.clone()
    later[:, 20:] = (x[:, 20:] + 1 + torch.randint(0, 255, (4, 12))) % 256
    with torch.no_grad():
        before, after = model(x), model(later)
    torch.testing.assert_close(before[:, :20], after[:, :20], rtol=0, atol=1e-6)
    assert (before[:, 20:] - after[:, 20:]).abs().amax(-1).min() > 1e-4  # every later position moved


@pytest.mark.parametrize("shape,cfg,message", [
    ((16,), SMALL, "--block-size 32 is longer than the data's blocks of 16 tokens"),
    ((8, 8), SMALL, "samples of shape (T,)"),
    ((128,), GPTConfig(n_embd=30, n_head=4), "--n-embd 30 must be a multiple of --n-head 4"),
])
def test_gpt_that_does_not_fit_the_data_says_what_to_change(shape, cfg, message):
    with pytest.raises(InputError) as info:
        build_model("gpt", shape, 256, gpt=cfg)
    assert message in str(info.value)


# ---- your own model ---------------------------------------------------------

ZOO = '''
import torch
from torch import nn

CALLS = []
NUMBER = 3


def good(sample_shape, num_classes):
    CALLS.append((sample_shape, num_classes))
    return nn.Linear(sample_shape[-1], num_classes)


class Zoo:
    @staticmethod
    def build(sample_shape, num_classes):
        return nn.Linear(sample_shape[-1], num_classes)


def raises(sample_shape, num_classes):
    raise RuntimeError("out of ideas")


def positional(shape, classes):
    return nn.Linear(shape[-1], classes)


def not_module(sample_shape, num_classes):
    return [nn.Linear(2, 2)]


def frozen(sample_shape, num_classes):
    return nn.Linear(2, 2).requires_grad_(False)
'''


@pytest.fixture
def zoo(tmp_path, monkeypatch):
    """Modules on sys.path: userzoo (factories good and bad), brokenzoo (raises on import),
    depzoo (imports a package that is not installed)."""
    (tmp_path / "userzoo.py").write_text(textwrap.dedent(ZOO))
    (tmp_path / "brokenzoo.py").write_text("import torch\nVALUE = 1 / 0\n")
    (tmp_path / "depzoo.py").write_text("import not_installed_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in ("userzoo", "brokenzoo", "depzoo"):
        sys.modules.pop(name, None)


def test_factory_is_called_with_the_sample_shape_and_class_count(zoo):
    model = build_model("userzoo:good", (40,), 10)
    assert isinstance(model, torch.nn.Linear) and (model.in_features, model.out_features) == (40, 10)
    assert sys.modules["userzoo"].CALLS == [((40,), 10)]  # keyword arguments, a tuple of ints
    assert isinstance(build_from_factory("userzoo:Zoo.build", (3, 5), 4), torch.nn.Linear)  # dotted


@pytest.mark.parametrize("spec,message", [
    ("userzoo", "'userzoo' is not a built-in model (mlp | cnn | resnet | gpt); give your own as package.module:"),
    ("userzoo:", "dotted Python names around one colon"),
    ("user zoo:good", "dotted Python names around one colon"),
    ("nosuchpkg_xyz.models:build", "there is no module 'nosuchpkg_xyz' to import; put the directory"),
    ("depzoo:build", "importing 'depzoo' failed: No module named 'not_installed_dependency_xyz'"),
    ("brokenzoo:build", "importing 'brokenzoo' raised ZeroDivisionError: division by zero (at "),
    ("userzoo:missing", "userzoo.py' has no attribute 'missing'; its callables: Zoo, frozen, good, not_module"),
    ("userzoo:NUMBER", "names a int, which is not callable; name a function or class"),
    ("userzoo:raises", "raised RuntimeError: out of ideas (at "),
    ("userzoo:positional", "raised TypeError"),
    ("userzoo:not_module", "returned a list, not a torch.nn.Module"),
    ("userzoo:frozen", "has no trainable parameters"),
])
def test_bad_factories_say_what_to_change(zoo, spec, message):
    with pytest.raises(InputError) as info:
        build_model(spec, (40,), 10)
    assert message in str(info.value), str(info.value)
    assert "\n" not in str(info.value)  # one line


def test_factory_errors_name_the_call_and_where_it_failed(zoo):
    with pytest.raises(InputError) as info:
        build_model("userzoo:raises", (40,), 10)
    assert "raises(sample_shape=(40,), num_classes=10)" in str(info.value)
    assert f"{zoo / 'userzoo.py'}:" in str(info.value)
    with pytest.raises(InputError, match="brokenzoo.py:2"):
        load_factory("brokenzoo:x")
    with pytest.raises(InputError, match="'userzoo' names no factory: give your own model as package.module:"):
        load_factory("userzoo")


# ---- the task ---------------------------------------------------------------

TOKENS = {"kind": "tokens", "vocab_size": 256}


@pytest.mark.parametrize("model,info,labels,message", [
    ("cnn", TOKENS, (64,), "--model cnn is a classifier, and d.h5 holds tokens"),
    ("gpt", {}, (), "--model gpt models language and needs token data"),
    ("gpt", TOKENS, (), "needs a next-token label at every position"),
    ("mlp", {}, (64,), "labels of shape (64,) per sample; classification takes one integer"),
])
def test_the_data_and_the_model_must_agree_on_the_task(model, info, labels, message):
    with pytest.raises(InputError) as err:
        choose_task(model, info, "d.h5", (64,), labels, classes=10, context=32)
    assert message in str(err.value)


def test_token_data_is_language_modelling_for_gpt_and_for_your_own_model():
    gpt = choose_task("gpt", TOKENS, "d.h5", (64,), (64,), classes=256, context=32)
    own = choose_task("pkg.mod:build", TOKENS, "d.h5", (64,), (64,), classes=200, context=32)
    assert isinstance(gpt, LanguageModelling) and (gpt.num_classes, gpt.context) == (256, 32)
    assert isinstance(own, LanguageModelling) and own.context is None and gpt.eval_batch == 1024
    other = choose_task("pkg.mod:build", {}, "d.h5", (40,), (), classes=10, context=32)
    assert isinstance(other, Classification) and other.num_classes == 10


def test_language_modelling_cuts_blocks_into_contexts_and_scores_every_position():
    task = LanguageModelling(256, context=16, block=40)
    x = torch.arange(2 * 40).reshape(2, 40).to(torch.uint8)
    y = x + 1
    xs, ys = task.inputs((x, y.long()), "cpu")
    assert xs.dtype == ys.dtype == torch.long and xs.shape == ys.shape == (4, 16)  # 40 // 16 = 2 per block
    assert torch.equal(xs[1], x[0, 16:32].long()) and torch.equal(ys, xs + 1)
    out = torch.randn(4, 16, 256, generator=torch.Generator().manual_seed(0))
    out[0, :10].scatter_(1, ys[0, :10, None], 100.0)  # right at 10 positions of context 0
    out[3, 4:].scatter_(1, ys[3, 4:, None], 100.0)  # ... and 12 of context 3
    want = torch.nn.functional.cross_entropy(out.reshape(-1, 256), ys.reshape(-1))
    torch.testing.assert_close(task.loss(out, ys), want)
    correct, samples = task.score(out, ys)
    right = (out.argmax(-1) == ys).sum().item()
    assert samples == 4 and right >= 22 and correct == pytest.approx(right / 16)  # in contexts
    loss_sum, _, _ = task.sums(out, ys)
    assert loss_sum == pytest.approx(want.item() * 4)
    record = task.metrics(2.0, 0.5, math.log(2), 0.4)
    assert record["test_bpb"] == pytest.approx(1.0) and record["train_bpb"] == pytest.approx(2 / math.log(2))


def test_classification_keeps_its_record_and_float_inputs():
    task = Classification(3)
    assert list(task.metrics(1.0, 0.5, 1.1, 0.4)) == ["train_loss", "train_acc", "test_loss", "test_acc"]
    x, y = task.inputs((torch.zeros(2, 5, dtype=torch.uint8), torch.tensor([0, 2])), "cpu")
    assert x.dtype == torch.float32 and y.tolist() == [0, 2]
    out = torch.tensor([[3.0, 0, 0], [0, 3.0, 0]])
    assert task.score(out, y) == (1.0, 2.0)
    loss_sum, correct, samples = task.sums(out, y)
    assert loss_sum == pytest.approx(torch.nn.functional.cross_entropy(out, y, reduction="sum").item())
