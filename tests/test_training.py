"""The training tools at CI scale: a synthetic corpus in the real on-disk format (xz
sources), the tokenizer trained on it, a tiny target and drafter trained for a few
dozen steps through the command line, their exports read by the serving loaders.

The steps run uncompiled: compiling the step for the CPU builds its kernels with the
system compiler the first time (tens of seconds), and compiled or not the step is the
same function. Runs are compared through held-out losses of the same fixed windows.
"""

from __future__ import annotations

import json
import lzma

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from daemon import cli
from families.lfm2.bpe import BOS, EOS_TEXT, IM_END, IM_START, MASK
from families.lfm2.checkpoint import open_target
from families.lfm2.drafter import DSparkDrafter, load_drafter
from families.lfm2.loader import load_model
from families.lfm2.tokenizer import ChatTokenizer
from families.lfm2.train import confidence, corpus, drafter, generate, loop, target
from families.lfm2.train.__main__ import main
from lanes.engine import Engine, EngineConfig
from lanes.lane import Request
from lanes.sampling import SamplingParams

ADJECTIVES = ["quick", "lazy", "bright", "silent", "ancient", "curious", "gentle", "bitter"]
NOUNS = ["fox", "river", "kernel", "prophet", "compiler", "garden", "lantern", "sparrow"]
VERBS = ["jumps over", "waits for", "speaks to", "remembers", "follows", "ignores"]


def sentence(rng: np.random.Generator) -> str:
    a, b = rng.choice(ADJECTIVES, 2)
    n, m = rng.choice(NOUNS, 2)
    return f"The {a} {n} {rng.choice(VERBS)} the {b} {m}."


def paragraphs(rng, count: int) -> str:
    return "\n\n".join(" ".join(sentence(rng) for _ in range(4)) for _ in range(count))


def write_xz(path, text: str) -> None:
    with lzma.open(path, "wt", encoding="utf-8") as f:
        f.write(text)


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    """Four sources in the corpus's formats: fortunes (%-separated), the Devil's
    Dictionary (entries), the Jargon File (:term: entries), plain prose."""
    rng = np.random.default_rng(0)
    out = tmp_path_factory.mktemp("corpus")
    write_xz(out / "fortunes.txt.xz", "\n%\n".join(f"{sentence(rng)}\n\t\t-- Author {i}" for i in range(300)) + "\n%\n")
    entries = [f"{n.upper()}{'S' * (i // len(NOUNS))}, n.  {sentence(rng)}\n{sentence(rng)}" for i, n in enumerate(NOUNS * 8)]
    write_xz(out / "devils-dictionary.txt.xz", "PREFACE\n\n" + "\n\n".join(entries) + "\n")
    jargon = [f"   :{n}{i}: //, n.\n\n   {sentence(rng)}\n   {sentence(rng)}\n" for i, n in enumerate(NOUNS * 8)]
    write_xz(out / "jargon.txt.xz", "\n".join(jargon))
    write_xz(out / "prose.txt.xz", paragraphs(rng, 400))
    return out


@pytest.fixture(scope="module")
def tokenizer_dir(corpus_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    assert main(["tokenizer", "--corpus", str(corpus_dir), "--out", str(out), "--vocab", "400"]) == 0
    return out


@pytest.fixture(scope="module")
def data_dir(corpus_dir, tokenizer_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("data")
    assert main(["corpus", "--corpus", str(corpus_dir), "--tokenizer", str(tokenizer_dir), "--out", str(out)]) == 0
    return out


TINY_RUN = ["--batch", "8", "--seq-len", "64", "--warmup", "5", "--log-every", "20", "--eval-windows", "16"]


@pytest.fixture(scope="module")
def target_run(tokenizer_dir, data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("target")
    args = ["target", "--shape", "tiny", "--tokenizer", str(tokenizer_dir), "--data", str(data_dir), "--out", str(out),
            "--steps", "80", "--lr", "3e-3", "--no-compile", *TINY_RUN]
    assert main(args) == 0
    return out


# --- corpus and tokenizer ---------------------------------------------------------------


def test_split_holds_out_the_tail_of_every_source(corpus_dir):
    train = list(corpus.documents(corpus_dir, "train"))
    held_out = list(corpus.documents(corpus_dir, "eval"))
    for source in ("fortunes", "devils-dictionary", "jargon", "prose"):
        assert any(d.source == source for d in held_out), source
    train_text = "".join(d.text for d in train)
    # No held-out fortune (each one is unique) appears among the training documents.
    for doc in held_out:
        if doc.source == "fortunes":
            assert doc.text not in train_text
    fortunes = [d for d in train if d.source == "fortunes"]
    assert 250 < len(fortunes) < 300 and all("%" not in d.text for d in fortunes)


def test_chat_examples_use_the_template_text(corpus_dir):
    chats = [d for d in corpus.documents(corpus_dir, "train") if d.source.endswith("/chat")]
    sources = {d.source for d in chats}
    assert sources == {"fortunes/chat", "devils-dictionary/chat", "jargon/chat"}
    define = next(d.text for d in chats if d.source == "devils-dictionary/chat")
    assert define.startswith("<|im_start|>user\nDefine fox.<|im_end|>\n<|im_start|>assistant\nFox, n. The ")
    assert define.endswith("<|im_end|>\n")
    jargon = next(d.text for d in chats if d.source == "jargon/chat")
    assert jargon.startswith("<|im_start|>user\nWhat is fox0?<|im_end|>\n<|im_start|>assistant\nThe ")


def test_tokenizer_round_trips_text_and_the_chat_template(tokenizer_dir):
    tok = ChatTokenizer(tokenizer_dir)
    assert tok.vocab_size == 400 and tok.token_to_id("<|mask|>") == MASK
    for text in ["The quiet kernel remembers the garden.", "naïve café — ünïcödé ✓ 日本", "  tabs\tand\nnewlines  "]:
        ids = tok.encode(text)
        assert ids[0] == BOS and tok.decode(ids) == text
    messages = [{"role": "user", "content": "Tell me something."}]
    ids = tok.encode_chat(messages)
    assert ids[:2] == [BOS, IM_START] and ids.count(IM_END) == 1
    assert tok.decode(ids, skip_special_tokens=False) == tok.render_chat(messages)
    assert tok.render_chat(messages) == "<|startoftext|>" + corpus.chat_text("Tell me something.", "")[: -len("<|im_end|>\n")]


def test_token_arrays_frame_every_document(corpus_dir, data_dir, tokenizer_dir):
    tokens = np.load(data_dir / "train.npy")
    assert tokens.dtype == np.uint16 and tokens[0] == BOS and tokens[-1] == EOS_TEXT
    starts, ends = np.flatnonzero(tokens == BOS), np.flatnonzero(tokens == EOS_TEXT)
    assert len(starts) == len(ends) and (ends[:-1] < starts[1:]).all() and (starts[1:] == ends[:-1] + 1).all()
    summary = json.loads((data_dir / "corpus.json").read_text())
    assert summary["parts"]["train"]["tokens"] == tokens.size
    assert len(starts) == sum(s["documents"] for s in summary["parts"]["train"]["sources"].values())
    first = next(corpus.documents(corpus_dir, "train"))
    assert ChatTokenizer(tokenizer_dir).decode(tokens[: ends[0] + 1].tolist()) == first.text


# --- target -----------------------------------------------------------------------------


def eval_loss(model, data_dir) -> float:
    windows = loop.eval_windows(np.load(data_dir / "eval.npy"), 65, 16)
    return target.evaluate(model, windows, 8)["eval_loss"]


def test_target_training_reduces_the_held_out_loss(target_run, tokenizer_dir, data_dir):
    config = json.loads((target_run / "model" / "config.json").read_text())
    untrained = target.build_model(config, seed=0)
    trained, _ = load_model(target_run / "model", dtype="float32")
    before, after = eval_loss(untrained, data_dir), eval_loss(trained, data_dir)
    assert before > 5.5 and after < before - 1.5, (before, after)


def test_exported_target_is_an_hf_directory_the_loader_reads(target_run):
    out = target_run / "model"
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "lfm2" and config["torch_dtype"] == "bfloat16"
    assert "full_attention" in config["layer_types"] and "conv" in config["layer_types"]
    assert {p.name for p in out.iterdir()} >= {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    stored = mx.load(str(out / "model.safetensors"))
    assert stored["model.layers.0.conv.conv.weight"].shape == (64, 1, 3)  # PyTorch Conv1d layout
    assert all(name.startswith("model.") and v.dtype == mx.bfloat16 for name, v in stored.items())
    # The export is the checkpoint's masters rounded to bfloat16.
    masters = mx.load(str(target_run / "checkpoint" / "params.safetensors"))
    model, _ = load_model(out, dtype="float32")
    loaded = dict(tree_flatten(model.parameters()))
    for name, value in masters.items():
        assert mx.allclose(loaded[name], value.astype(mx.bfloat16).astype(mx.float32)).item(), name


def test_exported_target_generates_through_the_cli(target_run, capsys):
    assert cli.main(["generate", "--model", str(target_run / "model"), "--chat", "Tell me something.", "--max-tokens", "8", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 1 <= len(result["token_ids"]) <= 8


def test_resume_restores_weights_optimizer_step_and_data_order(tokenizer_dir, data_dir, tmp_path):
    """A run stopped by its budget and resumed continues from exactly where it stood."""
    config = target.model_config(target.SHAPES["tiny"], 400)
    settings = loop.OptimizerSettings(lr=3e-3, warmup=5)
    tokens = np.load(data_dir / "train.npy")

    def new_run(minutes):
        stepper = loop.Stepper(target.build_model(config, seed=0), target.lm_loss, settings, "float32", compile=False)
        return loop.Run(stepper, tmp_path / "checkpoint", config, loop.RunSettings(minutes, 40, None, log_every=100), settings, seed=0)

    def next_batch(rng):
        return (mx.array(loop.random_windows(tokens, rng, 4, 33)),), 4 * 32

    first = new_run(minutes=0)  # the budget is spent at once: checkpoint the initial state...
    for _ in range(7):  # ...after a few steps taken by hand
        first.progress.step += 1
        first.stepper.step(first.schedule(first.progress.step), *next_batch(first.rng)[0])
    first.save()
    second = new_run(minutes=5)
    second.resume()
    assert second.progress.step == 7
    for name, value in dict(tree_flatten(first.stepper.master["params"])).items():
        assert mx.array_equal(value, dict(tree_flatten(second.stepper.master["params"]))[name]).item(), name
    for name, value in dict(tree_flatten(first.stepper.optimizer.state)).items():
        assert mx.array_equal(value, dict(tree_flatten(second.stepper.optimizer.state))[name]).item(), name
    assert np.array_equal(next_batch(first.rng)[0][0], next_batch(second.rng)[0][0])
    # The resumed run trains on to its step limit and writes a usable checkpoint.
    second.train(next_batch, lambda: {}, lambda result: None)
    assert loop.read_state(tmp_path / "checkpoint")["progress"]["step"] == 40


def test_starting_over_an_existing_run_is_refused(target_run, tokenizer_dir, data_dir, capsys):
    args = ["target", "--shape", "tiny", "--tokenizer", str(tokenizer_dir), "--data", str(data_dir), "--out", str(target_run), "--steps", "1"]
    assert main(args) == 2
    assert "pass --resume" in capsys.readouterr().err


# --- drafter ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def drafter_run(target_run, data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("drafter")
    args = ["drafter", "--shape", "tiny", "--target", str(target_run / "model"), "--data", str(data_dir), "--out", str(out),
            "--steps", "60", "--lr", "3e-3", "--anchors", "8", *TINY_RUN]
    assert main(args) == 0
    return out


def drafter_eval(model, target_model, data_dir) -> dict:
    windows = loop.eval_windows(np.load(data_dir / "eval.npy"), 64, 16)
    anchors = drafter.sample_anchors(np.random.default_rng(0), np.ones(len(windows), int), 64, 8, model.config.block_size)
    return drafter.evaluate(model, target_model, windows, anchors, 8, gamma=4.0)


def test_drafter_training_reduces_its_loss_and_loads(drafter_run, target_run, data_dir):
    target_model, target_cfg = load_model(target_run / "model", dtype="float32")
    config = json.loads((drafter_run / "model" / "config.json").read_text())
    assert config["architectures"] == ["Lfm2DSparkDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"mask_token_id": MASK, "target_layer_ids": [1, 2], "num_target_layers": 4}
    untrained = drafter.build_drafter(config, target_cfg.hidden_size, seed=0)
    loaded = load_drafter(drafter_run / "model", target_model, target_cfg, dtype="float32")
    before, after = drafter_eval(untrained, target_model, data_dir), drafter_eval(loaded.model, target_model, data_dir)
    assert after["eval_ce"] < before["eval_ce"] - 1.0, (before, after)
    assert after["eval_conf_err"] < before["eval_conf_err"], (before, after)


def test_training_forward_equals_serving_proposals(target_run, data_dir):
    """The batched training layout (many anchors, one masked attention per window) gives
    the chain logits and confidences that `DSparkDrafter.propose` gives for the same
    context and anchor, with the true tokens picked (teacher forcing)."""
    target_model, target_cfg = load_model(target_run / "model", dtype="float32")
    model = drafter.build_drafter(drafter.drafter_config(drafter.SHAPES["tiny"], target_cfg, MASK), target_cfg.hidden_size, seed=1)
    mx.random.seed(2)  # give the zero-initialised Markov and confidence heads real values
    model.markov_head.markov_w2.weight = 0.3 * mx.random.normal(model.markov_head.markov_w2.weight.shape)
    model.confidence_head.proj.weight = 0.1 * mx.random.normal(model.confidence_head.proj.weight.shape)
    window = np.load(data_dir / "eval.npy")[:48].astype(np.int32)
    anchors = [1, 9, 20, 43]
    tokens = mx.array(window[None])
    out = drafter.block_outputs(model, target_model, tokens, mx.array([anchors], dtype=mx.int32))
    _, tapped = target_model(tokens, taps=model.config.target_layer_ids)
    taps = mx.concatenate(tapped, axis=-1)[0]
    serving = DSparkDrafter(model, target_model, max_lanes=1)
    g = model.config.block_size
    for j, a in enumerate(anchors):
        lane = serving.open_lane()
        serving.append([lane], [taps[:a]], [window[:a].tolist()])
        truth = mx.array(window[a + 1 : a + 1 + g])
        proposal = serving.propose([lane], [int(window[a])], width=g, pick=lambda logits, k: truth[k : k + 1])
        assert mx.allclose(proposal.logits[0], out.logits[0, j], atol=1e-4).item()
        assert mx.allclose(proposal.confidences[0], mx.sigmoid(out.confidence_logits[0, j]), atol=1e-5).item()
        serving.close_lane(lane)


def test_block_mask_sees_the_context_before_the_anchor_and_its_own_block():
    mask = np.array(drafter.block_mask(mx.array([[2, 5]]), length=8, block=3))[0, 0]
    assert mask.shape == (6, 8 + 6)
    assert mask[:3, :8].tolist() == [[True, True] + [False] * 6] * 3
    assert mask[3:, :8].tolist() == [[True] * 5 + [False] * 3] * 3
    assert mask[:3, 8:].tolist() == [[True] * 3 + [False] * 3] * 3
    assert mask[3:, 8:].tolist() == [[False] * 3 + [True] * 3] * 3


# --- regenerated drafter data -----------------------------------------------------------


def test_generated_rows_are_the_targets_greedy_continuations(target_run, data_dir, tmp_path):
    out = tmp_path / "generated"
    args = ["generate", "--target", str(target_run / "model"), "--data", str(data_dir), "--out", str(out), "--sequences", "8",
            "--eval-sequences", "4", "--batch", "4", "--prompt-tokens", "12", "--new-tokens", "6", "--temperatures", "0",
            "--dtype", "float32"]
    assert main(args) == 0
    rows = np.load(out / "train.npy")
    assert rows.shape == (8, 18) and np.load(out / "eval.npy").shape == (4, 18)
    model, _ = load_model(target_run / "model", dtype="float32")
    for row in rows[:2].astype(np.int32):
        h, _ = model(mx.array(row[None, :-1]))
        greedy = np.array(mx.argmax(model.head(h), axis=-1))[0]
        assert (greedy[11:] == row[12:]).all()  # every generated token is the argmax after its prefix
    # The drafter anchors its blocks in the generated part only, and trains on it.
    data = drafter.DrafterData(out, "train", seq_len=999)
    windows, anchors = data.sample(np.random.default_rng(0), 4, 2, block=4)
    assert windows.shape == (4, 18) and anchors.min() >= 12 and anchors.max() <= 18 - 4 - 1
    run = ["drafter", "--shape", "tiny", "--target", str(target_run / "model"), "--data", str(out), "--out", str(tmp_path / "d"),
           "--steps", "3", "--anchors", "2", "--batch", "4", "--eval-windows", "4", "--warmup", "1"]
    assert main(run) == 0 and (tmp_path / "d" / "model" / "model.safetensors").exists()


def test_even_sources_draw_every_plain_source_alike(tmp_path):
    # Sources of very different sizes, each in its own range of token ids; the chat one is left out.
    sizes = {"big": 5000, "big/chat": 300, "small": 200, "tiny": 120}
    tokens = np.concatenate([100 * i + np.arange(n) % 50 for i, n in enumerate(sizes.values())]).astype(np.uint16)
    (tmp_path / "corpus.json").write_text(json.dumps({"parts": {"train": {"sources": {k: {"tokens": n} for k, n in sizes.items()}}}}))
    spans = generate.source_spans(tmp_path, "train", length=16)
    assert spans == [(0, 5000), (5300, 5500), (5500, 5620)]
    prompts = generate.Prompts(tokens, header=[999], length=16, chat_share=0.5, spans=spans)  # no reply starts: no chats
    windows = np.stack(prompts.draw(np.random.default_rng(0), 600))
    source = windows // 100
    assert windows.shape == (600, 16) and (source == source[:, :1]).all()  # each window inside one source
    counts = np.bincount(source[:, 0], minlength=4)
    assert counts[1] == 0 and all(150 < c < 250 for c in counts[[0, 2, 3]]), counts


def test_served_prompts_open_a_document_or_a_paragraph_as_a_user_sends_them():
    # Ids: 1 opens a document, 2 closes one, 5 ends a line, 6 ends a paragraph; 7 opens a chat turn, 7 8 the assistant's.
    line_ends = np.zeros(64, np.int8)
    line_ends[5], line_ends[6] = 1, 2
    chat = [1, 7, 9, 20, 21, 7, 8]  # a chat example up to its reply
    tokens = np.array([*chat, 22, 23, 2,
                       1, 30, 31, 32, 33, 6, 40, 41, 42, 43, 44, 5, 5, 50, 51, 52, 53, 54, 2,  # paragraphs at 30, 40, 50
                       1, 60, 61, 2], dtype=np.uint16)  # too short to open a served prompt
    prompts = generate.Prompts(tokens, header=[7, 8], length=12, chat_share=0.5, served_share=1.0, start=1, ends=(2,),
                               line_ends=line_ends)
    assert prompts.chats.tolist() == [[0, 7]] and [o.tolist() for o in prompts.openings] == [[11, 16, 23]]
    drawn = prompts.draw(np.random.default_rng(0), 200)
    chats = [p.tolist() for p in drawn if p.tolist() == chat]
    openings = [p.tolist() for p in drawn if p.tolist() != chat]
    assert 60 < len(chats) < 140 and len(chats) + len(openings) == 200
    for p in openings:  # the start token, then 4-11 tokens of one paragraph's document, never past its end
        assert p[0] == 1 and p[1] in (30, 40, 50) and 5 <= len(p) <= 12 and 2 not in p and 1 not in p[1:]
    assert {p[1] for p in openings} == {30, 40, 50} and max(map(len, openings)) == 12
    assert max(len(p) for p in openings if p[1] == 50) == 6  # its document ends after 5 tokens
    with pytest.raises(ValueError, match="start"):
        generate.Prompts(tokens, header=[7, 8], length=12, chat_share=0.5, served_share=0.5)


def test_served_rows_continue_prompts_of_every_length_to_one_row_length(target_run, data_dir, tmp_path):
    out = tmp_path / "served"
    args = ["generate", "--target", str(target_run / "model"), "--data", str(data_dir), "--out", str(out), "--sequences", "8",
            "--eval-sequences", "4", "--batch", "8", "--prompt-tokens", "24", "--new-tokens", "8", "--temperatures", "0",
            "--dtype", "float32", "--served-share", "1", "--chat-share", "0.5"]
    assert main(args) == 0
    rows, sizes = np.load(out / "train.npy").astype(np.int32), np.load(out / "train_prompts.npy")
    assert rows.shape == (8, 32) and sizes.shape == (8,) and (sizes <= 24).all() and len(set(sizes.tolist())) > 1
    assert (rows[:, 0] == 1).all()  # every prompt opens with the start token, as serving reads it
    model, _ = load_model(target_run / "model", dtype="float32")
    for row, size in zip(rows, sizes):
        h, _ = model(mx.array(row[None, :-1]))
        greedy = np.array(mx.argmax(model.head(h), axis=-1))[0]
        assert (greedy[size - 1 :] == row[size:]).all()  # after its own prompt, the target's greedy tokens
    data = drafter.DrafterData(out, "train", seq_len=999)
    windows, anchors = data.sample(np.random.default_rng(0), 64, 2, block=4)
    lows = np.array([sizes[np.flatnonzero((rows == w).all(axis=1))[0]] for w in windows])
    assert (anchors.min(axis=1) >= lows).all() and (anchors.min(axis=1) == lows).any()
    run = ["drafter", "--shape", "tiny", "--target", str(target_run / "model"), "--data", str(out), "--out", str(tmp_path / "d"),
           "--steps", "2", "--anchors", "2", "--batch", "4", "--eval-windows", "4", "--warmup", "1"]
    assert main(run) == 0
    assert main([*args[:-4], "--out", str(tmp_path / "bad"), "--served-share", "1.5"]) == 2


# --- the confidence refit ---------------------------------------------------------------


def test_refit_learns_which_drafts_survive():
    features = mx.random.normal((400, 5), key=mx.random.key(0))
    survived = (features[:, 0] > 0).astype(mx.float32)
    head = nn.Linear(5, 1)
    head.weight, head.bias = mx.zeros((1, 5)), mx.zeros((1,))
    confidence.refit(head, features, survived, steps=300, lr=0.05)
    c = mx.sigmoid(head(features).squeeze(-1))
    assert (c * survived).sum().item() / survived.sum().item() > 0.8
    assert (c * (1 - survived)).sum().item() / (1 - survived).sum().item() < 0.2


def test_confidence_step_refits_the_head_alone(drafter_run, target_run, data_dir, tmp_path):
    gen = tmp_path / "gen"
    args = ["generate", "--target", str(target_run / "model"), "--data", str(data_dir), "--out", str(gen), "--sequences", "32",
            "--eval-sequences", "8", "--batch", "16", "--prompt-tokens", "16", "--new-tokens", "16", "--temperatures", "0",
            "--dtype", "float32", "--even-sources"]
    assert main(args) == 0 and json.loads((gen / "generated.json").read_text())["even_sources"]
    out = tmp_path / "refit"
    args = ["confidence", "--target", str(target_run / "model"), "--drafter", str(drafter_run / "model"), "--data", str(gen),
            "--out", str(out), "--windows", "32", "--eval-windows", "8", "--anchors", "4", "--batch", "8", "--steps", "50"]
    assert main(args) == 0
    before, after = mx.load(str(drafter_run / "model" / "model.safetensors")), mx.load(str(out / "model.safetensors"))
    assert sorted(before) == sorted(after)
    changed = {name for name in before if not mx.array_equal(before[name], after[name]).item()}
    assert changed == {"confidence_head.proj.weight", "confidence_head.proj.bias"}
    refit = json.loads((out / "training.json").read_text())["confidence_refit"]
    assert refit["label"] == "greedy survival" and set(refit["eval_after"]["per_row"]) <= {str(k) for k in range(4)}
    target_model, target_cfg = load_model(target_run / "model", dtype="float32")
    assert load_drafter(out, target_model, target_cfg, dtype="float32").config.block_size == 4



def test_init_continues_an_exported_drafter(drafter_run, target_run, data_dir, tmp_path):
    target_model, target_cfg = load_model(target_run / "model", dtype="float32")
    config = json.loads((drafter_run / "model" / "config.json").read_text())
    out = tmp_path / "more"
    args = ["drafter", "--init", str(drafter_run / "model"), "--target", str(target_run / "model"), "--data", str(data_dir),
            "--out", str(out), "--steps", "20", "--lr", "1e-3", "--anchors", "8", *TINY_RUN]
    assert main(args) == 0
    assert json.loads((out / "model" / "config.json").read_text()) == config
    assert json.loads((out / "model" / "training.json").read_text())["init"] == str(drafter_run / "model")
    untrained = drafter_eval(drafter.build_drafter(config, target_cfg.hidden_size, seed=0), target_model, data_dir)
    before = drafter_eval(load_drafter(drafter_run / "model", target_model, target_cfg, dtype="float32").model, target_model, data_dir)
    after = drafter_eval(load_drafter(out / "model", target_model, target_cfg, dtype="float32").model, target_model, data_dir)
    # 20 steps from scratch stay near the untrained loss; from the exported weights they
    # start where the first run ended.
    assert after["eval_ce"] < untrained["eval_ce"] - 1.0 and after["eval_ce"] < before["eval_ce"] + 0.1, (untrained, before, after)


def test_init_can_grow_the_block(drafter_run, target_run, data_dir, tmp_path):
    """No weight depends on the block's length: an exported drafter trains on to a longer
    block, and the engine serves the longer block, drafted output equal to plain."""
    config = json.loads((drafter_run / "model" / "config.json").read_text())
    longer = config["block_size"] + 3
    out = tmp_path / "longer"
    args = ["drafter", "--init", str(drafter_run / "model"), "--block-size", str(longer), "--target", str(target_run / "model"),
            "--data", str(data_dir), "--out", str(out), "--steps", "3", "--anchors", "8", *TINY_RUN]
    assert main(args) == 0
    assert json.loads((out / "model" / "config.json").read_text()) == {**config, "block_size": longer}
    loaded = open_target(target_run / "model", dtype="float32", max_lanes=1)
    grown = load_drafter(out / "model", loaded.target.model, loaded.target.config, dtype="float32", max_lanes=1)
    assert grown.width == longer
    prompt = np.load(data_dir / "eval.npy")[:24].astype(int).tolist()
    outputs = [Engine(loaded.target, loaded.tokenizer, frozenset(), d, EngineConfig(max_streams=1, draft_width=w))
               .generate([Request(prompt, 24)])[0] for d, w in ((None, None), (grown, longer + 1))]
    assert len(outputs[0].token_ids) == 24 and outputs[1].token_ids == outputs[0].token_ids
    assert outputs[1].draft.drafted_rounds > 0


def test_init_and_resume_are_exclusive(drafter_run, target_run, data_dir, tmp_path, capsys):
    args = ["drafter", "--init", str(drafter_run / "model"), "--resume", "--target", str(target_run / "model"),
            "--data", str(data_dir), "--out", str(tmp_path / "x"), *TINY_RUN]
    assert main(args) != 0
    assert "give one of them" in capsys.readouterr().err


def test_soft_labels_mix_in_the_targets_distribution():
    """Share 0 is the label's cross-entropy; share 1 is -sum_v p_target(v) log p_draft(v),
    computed here by hand in numpy; a share between mixes the two linearly."""
    rng = np.random.default_rng(0)
    logits, target_logits = (rng.normal(size=(2, 3, 4, 11)).astype(np.float32) for _ in range(2))
    labels = rng.integers(0, 11, size=(2, 3, 4))
    out = drafter.BlockOutputs(mx.array(logits), mx.array(labels), None, None, None, mx.array(target_logits), None)

    def log_softmax(x):
        return x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))

    hard = -np.take_along_axis(log_softmax(logits), labels[..., None], axis=-1)[..., 0]
    soft = -(np.exp(log_softmax(target_logits)) * log_softmax(logits)).sum(-1)
    np.testing.assert_allclose(np.array(drafter.block_cross_entropy(out)), hard, rtol=1e-5)
    np.testing.assert_allclose(np.array(drafter.block_cross_entropy(out, 1.0)), soft, rtol=1e-5)
    np.testing.assert_allclose(np.array(drafter.block_cross_entropy(out, 0.25)), 0.75 * hard + 0.25 * soft, rtol=1e-5)


def test_soft_label_training_runs_and_a_share_outside_0_1_is_refused(drafter_run, target_run, data_dir, tmp_path, capsys):
    base = ["drafter", "--init", str(drafter_run / "model"), "--target", str(target_run / "model"), "--data", str(data_dir),
            "--anchors", "8", *TINY_RUN]
    assert main([*base, "--out", str(tmp_path / "bad"), "--soft-labels", "1.5"]) == 2
    assert "--soft-labels" in capsys.readouterr().err
    assert main([*base, "--out", str(tmp_path / "soft"), "--steps", "5", "--soft-labels", "0.5"]) == 0
    assert json.loads((tmp_path / "soft" / "model" / "training.json").read_text())["soft_labels"] == 0.5


def test_widening_the_mlp_keeps_what_the_drafter_computes(drafter_run, target_run, data_dir, tmp_path):
    target_model, target_cfg = load_model(target_run / "model", dtype="float32")
    config = json.loads((drafter_run / "model" / "config.json").read_text())
    weights = dict(mx.load(str(drafter_run / "model" / "model.safetensors")))
    wider = drafter.widen_mlp(weights, config["intermediate_size"], 2 * config["intermediate_size"], seed=0)
    assert wider["layers.0.mlp.down_proj.weight"].shape[1] == 2 * config["intermediate_size"]
    narrow_model = drafter.build_drafter(config, target_cfg.hidden_size, seed=0)
    narrow_model.load_weights(list(weights.items()))
    wide_model = drafter.build_drafter({**config, "intermediate_size": 2 * config["intermediate_size"]}, target_cfg.hidden_size, seed=0)
    wide_model.load_weights(list(wider.items()))
    tokens = mx.array(np.load(data_dir / "eval.npy")[:64].astype(np.int32)[None])
    anchors = mx.array([[5, 20, 40]], dtype=mx.int32)
    a, b = (drafter.block_outputs(m, target_model, tokens, anchors) for m in (narrow_model, wide_model))
    np.testing.assert_allclose(np.array(a.logits), np.array(b.logits), atol=1e-4)
    # Trained on from there, the new units learn; a narrower width is refused.
    base = ["drafter", "--init", str(drafter_run / "model"), "--target", str(target_run / "model"), "--data", str(data_dir),
            "--anchors", "8", *TINY_RUN]
    assert main([*base, "--out", str(tmp_path / "w"), "--steps", "5", "--intermediate", str(2 * config["intermediate_size"])]) == 0
    exported = mx.load(str(tmp_path / "w" / "model" / "model.safetensors"))
    assert json.loads((tmp_path / "w" / "model" / "config.json").read_text())["intermediate_size"] == 2 * config["intermediate_size"]
    assert mx.abs(exported["layers.0.mlp.down_proj.weight"][:, config["intermediate_size"]:]).max().item() > 0
    assert main([*base, "--out", str(tmp_path / "n"), "--intermediate", "8"]) == 2


def test_deepening_keeps_what_the_drafter_computes(drafter_run, target_run, data_dir, tmp_path):
    target_model, target_cfg = load_model(target_run / "model", dtype="float32")
    config = json.loads((drafter_run / "model" / "config.json").read_text())
    layers = config["num_hidden_layers"]
    weights = dict(mx.load(str(drafter_run / "model" / "model.safetensors")))
    shallow = drafter.build_drafter(config, target_cfg.hidden_size, seed=0)
    shallow.load_weights(list(weights.items()))
    deep = drafter.build_drafter({**config, "num_hidden_layers": layers + 2}, target_cfg.hidden_size, seed=1)
    grown = drafter.deepen(weights, dict(tree_flatten(deep.parameters())))
    assert mx.abs(grown[f"layers.{layers}.self_attn.q_proj.weight"]).max().item() > 0  # the new layers learn
    assert mx.abs(grown[f"layers.{layers + 1}.mlp.down_proj.weight"]).max().item() == 0  # and write nothing yet
    deep.load_weights(list(grown.items()))
    tokens = mx.array(np.load(data_dir / "eval.npy")[:64].astype(np.int32)[None])
    anchors = mx.array([[5, 20, 40]], dtype=mx.int32)
    a, b = (drafter.block_outputs(m, target_model, tokens, anchors) for m in (shallow, deep))
    np.testing.assert_allclose(np.array(a.logits), np.array(b.logits), atol=1e-5)
    np.testing.assert_allclose(np.array(a.confidence_logits), np.array(b.confidence_logits), atol=1e-5)
    # Trained on from there, the new layers write; fewer layers, or deepening a new drafter, is refused.
    base = ["drafter", "--target", str(target_run / "model"), "--data", str(data_dir), "--anchors", "8", *TINY_RUN]
    init = ["--init", str(drafter_run / "model")]
    assert main([*base, *init, "--out", str(tmp_path / "d"), "--steps", "5", "--layers", str(layers + 1)]) == 0
    exported = mx.load(str(tmp_path / "d" / "model" / "model.safetensors"))
    assert json.loads((tmp_path / "d" / "model" / "config.json").read_text())["num_hidden_layers"] == layers + 1
    assert mx.abs(exported[f"layers.{layers}.mlp.down_proj.weight"]).max().item() > 0
    assert main([*base, *init, "--out", str(tmp_path / "s"), "--layers", str(layers - 1)]) == 2
    assert main([*base, "--out", str(tmp_path / "n"), "--layers", str(layers + 1)]) == 2


def test_generated_rows_with_a_penalty_are_what_the_engine_writes(target_run, data_dir, tmp_path):
    """Greedy with a repetition penalty, the trainer's batched writing (its own penalty
    over each row's prompt and tokens) gives the lane core's tokens for the same prompt
    and settings (an independent implementation)."""
    out = tmp_path / "penalised"
    args = ["generate", "--target", str(target_run / "model"), "--data", str(data_dir), "--out", str(out), "--sequences", "4",
            "--eval-sequences", "4", "--batch", "4", "--prompt-tokens", "12", "--new-tokens", "10", "--temperatures", "0",
            "--dtype", "float32", "--repetition-penalty", "1.5"]
    assert main(args) == 0
    assert json.loads((out / "generated.json").read_text())["repetition_penalty"] == 1.5
    loaded = open_target(target_run / "model", dtype="float32", max_lanes=1)
    engine = Engine(loaded.target, loaded.tokenizer, frozenset(), None, EngineConfig(max_streams=1))
    rows = np.load(out / "train.npy").astype(np.int32)
    unpenalised = 0
    for row in rows:
        (done,) = engine.generate([Request(row[:12].tolist(), 10, sampling=SamplingParams(temperature=0, repetition_penalty=1.5))])
        assert done.token_ids == row[12:].tolist()
        (plain,) = engine.generate([Request(row[:12].tolist(), 10)])
        unpenalised += plain.token_ids != row[12:].tolist()
    assert unpenalised  # the penalty changed what was written
    assert main([*args[:-2], "--out", str(tmp_path / "bad"), "--repetition-penalty", "0"]) == 2


def test_the_writers_min_p_keeps_only_tokens_near_the_best():
    logits = mx.array([[2.0, 1.9, 0.0, -1.0]] * 256)  # p(1)/p(0) = 0.90, p(2)/p(0) = 0.14
    seen = mx.zeros(logits.shape, dtype=mx.bool_)
    mx.random.seed(0)
    drawn = np.array(generate.pick(logits, None, generate.Decoding(1.0, min_p=0.5)))
    assert set(drawn.tolist()) == {0, 1}
    # A penalty of 4 on token 0 (2.0 -> 0.5) leaves token 1 the best, and 0 below half of it.
    assert set(np.array(generate.pick(logits, seen.at[:, 0].maximum(mx.array(True)), generate.Decoding(1.0, 4.0, 0.5))).tolist()) == {1}
