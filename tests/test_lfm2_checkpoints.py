"""Reading checkpoint directories: config facts, accepted layouts, and refusals that name
the problem."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tokenizers import Tokenizer

from bench.scripted import ScriptedDrafter, published_profile
from daemon.cli import main
from families.lfm2 import CheckpointError, Lfm2Config, load_model, open_target
from families.lfm2.bpe import EOS_TEXT, IM_END
from families.lfm2.drafter import load_drafter
from families.lfm2.tiny import TinyShape, make_tiny_target
from families.lfm2.tiny_drafter import make_tiny_drafter
from families.lfm2.tokenizer import ChatTokenizer
from lanes.engine import Engine, EngineConfig
from lanes.lane import FinishReason, Request

PROMPT = mx.array([[1, 40, 41, 42, 43, 300, 301, 17]])


def copy_of(path, tmp_path):
    return shutil.copytree(path, tmp_path / "copy")


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))


def edit_tensors(path, edit):
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_nested_rope_theta_wins_over_top_level_and_default():
    base = {"model_type": "lfm2", "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1, "layer_types": ["conv"]}
    assert Lfm2Config.from_dict(base).rope_theta == 1e6
    assert Lfm2Config.from_dict({**base, "rope_theta": 5e6}).rope_theta == 5e6
    nested = {**base, "rope_theta": 1e6, "rope_parameters": {"rope_type": "default", "rope_theta": 1e7}}
    assert Lfm2Config.from_dict(nested).rope_theta == 1e7


def test_nested_theta_reaches_the_attention(tmp_path):
    path = make_tiny_target(tmp_path, "lfm2", seed=4, shape=TinyShape(rope_theta=1e7))
    edit_config(path, rope_theta=1e6)  # a stale top-level value that must lose
    model, config = load_model(path)
    assert config.rope_theta == 1e7
    assert all(layer.self_attn.rope_theta == 1e7 for layer in model.layers if layer.is_attention)


def test_full_attn_idxs_is_read_like_layer_types(dense_dir, tmp_path):
    path = copy_of(dense_dir, tmp_path)
    kinds = Lfm2Config.from_dir(path).layer_kinds
    edit_config(path, layer_types=None, full_attn_idxs=[i for i, k in enumerate(kinds) if k == "full_attention"])
    assert Lfm2Config.from_dir(path).layer_kinds == kinds


def test_both_moe_expert_layouts_give_identical_logits(moe_dir, moe_fused_dir):
    per_expert, _ = load_model(moe_dir)
    fused, _ = load_model(moe_fused_dir)
    a, _ = per_expert(PROMPT)
    b, _ = fused(PROMPT)
    assert np.array_equal(np.array(per_expert.head(a)), np.array(fused.head(b)))


def test_mlx_conv_layout_is_accepted(dense_dir, tmp_path):
    path = copy_of(dense_dir, tmp_path)
    reference, _ = load_model(dense_dir)

    def to_mlx_layout(t):
        for name in [n for n in t if n.endswith("conv.conv.weight")]:
            t[name] = np.ascontiguousarray(t[name].transpose(0, 2, 1))

    edit_tensors(path, to_mlx_layout)
    converted, _ = load_model(path)
    assert np.array_equal(np.array(reference.head(reference(PROMPT)[0])), np.array(converted.head(converted(PROMPT)[0])))


def test_expert_bias_stays_float32(moe_dir):
    model, _ = load_model(moe_dir, dtype="float16")
    moe = model.layers[-1].feed_forward
    assert moe.expert_bias.dtype == mx.float32 and moe.gate.weight.dtype == mx.float32
    assert model.layers[-1].operator_norm.weight.dtype == mx.float16


def test_mlx_quantized_checkpoint_loads(dense_dir, tmp_path):
    """An MLX-quantized directory (.scales/.biases + a quantization block, as mlx-lm writes
    them) loads to exactly the model that was quantized and saved."""
    import mlx.nn as nn

    source, _ = load_model(dense_dir)
    nn.quantize(source, group_size=32, bits=8)
    path = copy_of(dense_dir, tmp_path)
    (path / "model.safetensors").unlink()
    mx.save_safetensors(str(path / "model.safetensors"), {"model." + k: v for k, v in nn.utils.tree_flatten(source.parameters())})
    edit_config(path, quantization={"group_size": 32, "bits": 8})
    loaded, _ = load_model(path)
    assert isinstance(loaded.layers[0].feed_forward.w1, nn.QuantizedLinear)
    assert np.array_equal(np.array(loaded.head(loaded(PROMPT)[0])), np.array(source.head(source(PROMPT)[0])))


REFUSALS = [
    ("missing tensor", lambda p: edit_tensors(p, lambda t: t.pop("model.layers.1.conv.out_proj.weight")), "model.layers.1.conv.out_proj.weight"),
    ("wrong shape", lambda p: edit_tensors(p, lambda t: t.update({"model.layers.0.ffn_norm.weight": np.ones(7, np.float32)})), "model.layers.0.ffn_norm.weight has shape (7,)"),
    ("unknown model_type", lambda p: edit_config(p, model_type="llama"), "model_type 'llama'"),
    ("bad layer kinds", lambda p: edit_config(p, layer_types=["conv", "mamba", "conv", "conv", "conv", "full_attention"]), "unknown layer kinds ['mamba']"),
    ("wrong layer count", lambda p: edit_config(p, layer_types=["conv"]), "'layer_types' must list 6"),
    ("non-finite theta", lambda p: edit_config(p, rope_parameters={"rope_theta": float("inf")}), "'rope_theta' must be a finite positive number"),
    ("negative theta", lambda p: edit_config(p, rope_theta=-1.0, rope_parameters=None), "'rope_theta' must be a finite positive number"),
    ("no weights", lambda p: (p / "model.safetensors").unlink(), "holds no *.safetensors"),
    ("broken json", lambda p: (p / "config.json").write_text("{"), "config.json is not valid JSON"),
]


@pytest.mark.parametrize("case,plant,message", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_malformed_checkpoints_are_refused_by_name(case, plant, message, dense_dir, tmp_path, capsys):
    path = copy_of(dense_dir, tmp_path)
    plant(path)
    with pytest.raises(CheckpointError, match=None) as refused:
        load_model(path)
    assert message in str(refused.value)
    # From the command line: one line naming the problem and exit status 2, no traceback.
    assert main(["generate", "--model", str(path), "--prompt", "hi", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


# ---- eos ids, from each of the three files that may name them --------------------------------

EOS_PROMPT = [1, 40, 41, 42, 43, 300, 301, 17]
EOS_SOURCES = ["config.json", "generation_config.json", "tokenizer_config.json"]
# What each stock tiny file names: the loader takes the union.
STOCK_EOS = {"config.json": {IM_END}, "generation_config.json": {IM_END, EOS_TEXT}, "tokenizer_config.json": {IM_END}}


@pytest.fixture(scope="module")
def eos_drafter_dir(dense_dir, tmp_path_factory):
    return make_tiny_drafter(tmp_path_factory.mktemp("eos_drafter"), dense_dir, seed=5, block_size=9)


@pytest.fixture(scope="module")
def unstopped(dense_dir):
    """The stock checkpoint's greedy reply, and a token of it to stop at: one whose first
    time in the reply comes after a few others."""
    loaded = open_target(dense_dir, max_lanes=1)
    (done,) = Engine(loaded.target, loaded.tokenizer, loaded.eos_ids, config=EngineConfig(max_streams=1)).generate([Request(EOS_PROMPT, 24)])
    reply = done.token_ids
    assert set(loaded.eos_ids) == set().union(*STOCK_EOS.values())
    assert len(reply) == 24 and not set(reply) & set(loaded.eos_ids)
    stop_at = next(i for i in range(4, len(reply)) if reply[i] not in reply[:i])
    return reply, stop_at


def name_eos(path, source: str, token: int) -> None:
    """Make `source` in the checkpoint at `path` name `token` as its eos."""
    file = path / source
    settings = json.loads(file.read_text())
    if source == "tokenizer_config.json":  # a token's text, not its id
        settings["eos_token"] = Tokenizer.from_file(str(path / "tokenizer.json")).id_to_token(token)
    else:
        settings["eos_token_id"] = [token] if source == "generation_config.json" else token
    file.write_text(json.dumps(settings))


@pytest.mark.parametrize("source", EOS_SOURCES)
def test_an_eos_id_from_each_file_stops_a_lane(source, dense_dir, eos_drafter_dir, unstopped, tmp_path):
    reply, stop_at = unstopped
    token = reply[stop_at]
    path = copy_of(dense_dir, tmp_path)
    name_eos(path, source, token)
    loaded = open_target(path, max_lanes=1)
    assert set(loaded.eos_ids) == {token}.union(*(STOCK_EOS[f] for f in EOS_SOURCES if f != source))
    (plain,) = Engine(loaded.target, loaded.tokenizer, loaded.eos_ids, config=EngineConfig(max_streams=1)).generate([Request(EOS_PROMPT, 24)])
    assert plain.token_ids == reply[:stop_at] and plain.finish_reason is FinishReason.STOP
    # Drafted, the eos arrives inside a block of accepted drafts: nothing after it is kept.
    drafter = ScriptedDrafter(load_drafter(eos_drafter_dir, loaded.target.model, loaded.target.config, max_lanes=1),
                              [EOS_PROMPT + reply], published_profile(), loaded.target.vocab_size)
    engine = Engine(loaded.target, loaded.tokenizer, loaded.eos_ids, drafter, EngineConfig(max_streams=1, draft_width=10))
    (drafted,) = engine.generate([Request(EOS_PROMPT, 24)])
    assert drafted.token_ids == reply[:stop_at] and drafted.finish_reason is FinishReason.STOP
    *earlier, last = drafted.draft.accepted_per_round
    assert stop_at < 1 + sum(1 + a for a in earlier) + last  # the eos was one of the last round's kept drafts


# ---- the chat template is data from a download ------------------------------------------------


def hostile_templates(marker) -> list[str]:
    """Templates that reach for Python's internals; the last two would create `marker`."""
    return [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{% for c in [].__class__.__base__.__subclasses__() %}{{ c }}{% endfor %}",
        "{{ messages.append({'role': 'system', 'content': 'injected'}) }}",
        f"{{{{ cycler.__init__.__globals__.os.system('touch {marker}') }}}}",
        f"{{{{ lipsum.__globals__['os'].popen('touch {marker}').read() }}}}",
    ]


@pytest.mark.parametrize("case", range(5))
def test_a_hostile_chat_template_is_refused_not_run(case, dense_dir, tmp_path):
    path = copy_of(dense_dir, tmp_path)
    marker = tmp_path / "ran"
    (path / "chat_template.jinja").write_text(hostile_templates(marker)[case])
    tokenizer = ChatTokenizer(path)
    with pytest.raises(ValueError, match="the chat template refused these messages: access to attribute .* is unsafe"):
        tokenizer.render_chat([{"role": "user", "content": "hi"}])
    assert not marker.exists()


def test_a_lone_reach_for_internals_renders_nothing_of_them(dense_dir, tmp_path):
    # The sandbox turns one unsafe attribute into an undefined value (as transformers'
    # does): nothing runs and nothing leaks; only going further through it raises.
    path = copy_of(dense_dir, tmp_path)
    (path / "chat_template.jinja").write_text("[{{ ''.__class__ }}{{ messages[0].__class__ }}{{ '{0.__class__}'.format(messages) }}]")
    assert ChatTokenizer(path).render_chat([{"role": "user", "content": "hi"}]) == "[]"
