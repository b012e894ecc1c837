"""Training and evaluating the tiny SDAR model (tandem/engine/diffusion/train.py, evaluate.py, tasks.py) and the
checkpoint committed in tandem/engine/diffusion/assets/tiny-sdar."""
from __future__ import annotations

import json
import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

from tokenizers import Tokenizer as HFTokenizer  # noqa: E402

from tandem.cli.main import main  # noqa: E402
from tandem.engine.diffusion import TINY_SDAR, DllmConfig, generate_cached, generate_reference  # noqa: E402
from tandem.engine.diffusion.evaluate import evaluate  # noqa: E402
from tandem.engine.diffusion.tasks import LETTERS, TASKS, draw, eval_set, held_out  # noqa: E402
from tandem.engine.diffusion.train import (TrainConfig, block_diffusion_mask, dense_hidden,  # noqa: E402
                                           diffusion_loss, init_model, make_batch, make_batches, ntp_batch, train)
from tandem.engine.loader import load_model  # noqa: E402
from tandem.engine.models import BlockDiffusionMetadata  # noqa: E402
from tandem.engine.sampling_params import SamplingParams  # noqa: E402
from tandem.engine.tiny_model import SDAR_VOCAB_SIZE, arch_tokenizer  # noqa: E402

MASK, EOS = 9, 8


@pytest.fixture(scope="module")
def tiny():
    model, cfg = load_model(TINY_SDAR, dtype="float32")
    return model, HFTokenizer.from_file(str(TINY_SDAR / "tokenizer.json"))


def test_block_diffusion_mask_is_bd3lm_s():
    """Protects: the training mask: noisy block k sees itself and the clean blocks before k, clean blocks are
    block-causal and never see noisy tokens (B=2, L=4: noisy 0..3, clean 4..5 = clean block 0 only)."""
    m = block_diffusion_mask(4, 2).int().tolist()
    assert m == [[1, 1, 0, 0, 0, 0],
                 [1, 1, 0, 0, 0, 0],
                 [0, 0, 1, 1, 1, 1],
                 [0, 0, 1, 1, 1, 1],
                 [0, 0, 0, 0, 1, 1],
                 [0, 0, 0, 0, 1, 1]]
    full = block_diffusion_mask(4, 2, with_last_clean=True)
    assert full.shape == (8, 8) and full[6:, 4:].int().tolist() == [[1, 1, 1, 1], [1, 1, 1, 1]]
    assert not full[4:, :4].any()


def test_make_batch_masks_answer_tokens_only_and_weights_by_one_over_t():
    """Protects: the noise: prompt tokens are never masked, answer and EOS-padding tokens are, the targets are the
    clean tokens, weights are 1/t of the token's block, and the denominator counts every answer position."""
    g = torch.Generator().manual_seed(0)
    b = make_batch([([1, 2, 3], [4, 5]), ([1, 2, 3, 4, 5], [6])], 4, MASK, EOS, 1e-3, g)
    L = 8
    assert b.ids.shape == (2, L + L - 4) and b.positions.tolist() == list(range(8)) + list(range(4))
    noisy, clean = b.ids[:, :L], b.ids[:, L:]
    assert clean.tolist() == [[1, 2, 3, 4], [1, 2, 3, 4]]
    assert (noisy[0, :3] == torch.tensor([1, 2, 3])).all() and (noisy[1, :5] == torch.tensor([1, 2, 3, 4, 5])).all()
    assert b.num_answer == 5 + 3          # [4, 5, EOS, EOS, EOS] and [6, EOS, EOS]
    flat = b.ids.reshape(-1)
    assert (flat[b.rows] == MASK).all() and int((noisy == MASK).sum()) == len(b.rows)
    want = {0: [1, 2, 3, 4, 5, EOS, EOS, EOS], 1: [1, 2, 3, 4, 5, 6, EOS, EOS]}
    for r, t, w in zip(b.rows.tolist(), b.targets.tolist(), b.weights.tolist()):
        n, p = divmod(r, b.ids.shape[1])
        assert t == want[n][p] and w >= 1.0
    assert len(make_batches([([1] * 3, [2]), ([1] * 6, [2, 3])], 4, MASK, EOS, 1e-3, g)) == 2


def test_training_forward_equals_the_engine_forward(tiny):
    """Protects: the differentiable training forward computes what the engine's inference forward computes: a noisy
    block beside the clean blocks before it equals the engine's block-causal forward over [clean prefix, noisy]."""
    model, _ = tiny
    ids = torch.tensor([(7 * i + 3) % 380 for i in range(64)])
    noisy = ids.clone()
    noisy[40:50] = model.mask_token_id
    with torch.no_grad():
        h = dense_hidden(model, model.model.embed_tokens.weight, torch.cat([noisy, ids[:32]])[None],
                         torch.cat([torch.arange(64), torch.arange(32)]), block_diffusion_mask(64, 32))[0]
        meta = BlockDiffusionMetadata.build([range(64)], [0], [0], None, 1, 32)
        engine = model(torch.cat([ids[:32], noisy[32:]]), None, None, meta)
    assert (h[32:64] - engine[32:]).abs().max() < 1e-4 and (h[64:] - engine[:32]).abs().max() < 1e-4


def test_a_few_training_steps_lower_the_loss_and_repeat_exactly():
    """Protects: the training code learns (40 steps at least halve the loss on a fixed held-out batch) and is
    reproducible (the same seed gives the same losses)."""
    cfg = TrainConfig(seed=7, steps=40, batch_size=16, warmup=5, threads=1)
    tok = arch_tokenizer("sdar")
    rng = random.Random(3)
    pairs = [(tok.encode(e.prompt).ids, tok.encode(e.answer).ids)
             for e in (draw(TASKS[i % len(TASKS)], rng, heldout=True) for i in range(24))]
    model0, embed0, conf = init_model(cfg.seed, cfg.init_std, cfg.embed_std)

    def held_loss(model, embed):
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            batches = make_batches(pairs, conf["block_size"], conf["mask_token_id"], conf["eos_token_id"], 1e-3, g)
            return diffusion_loss(model, embed, batches, SDAR_VOCAB_SIZE).item()

    before = held_loss(model0, embed0)
    result = train(cfg, progress=False)
    after = held_loss(result.model, result.model.model.embed_tokens.weight[:embed0.shape[0]])
    assert after < 0.5 * before, (before, after)
    again = train(TrainConfig(seed=7, steps=6, batch_size=16, warmup=5, threads=1), progress=False)
    assert again.losses == result.losses[:6]


def test_training_with_mixed_block_sizes_draws_a_size_per_step_reproducibly(monkeypatch):
    """Protects --train-block-sizes: each diffusion step's batches are noised with a block size drawn from the set
    (its own seeded stream, so the same seed gives the same sizes and losses), every size divides the model's 32,
    and with an empty set every step uses the model's block size."""
    from tandem.engine.diffusion import train as tr
    seen: list[int] = []
    real = tr.make_batches

    def spy(pairs, B, *rest):
        seen.append(B)
        return real(pairs, B, *rest)
    monkeypatch.setattr(tr, "make_batches", spy)
    cfg = TrainConfig(seed=7, steps=8, batch_size=4, warmup=2, block_sizes=(4, 32), threads=1)
    first = train(cfg, progress=False)
    sizes, seen[:] = list(seen), []
    again = train(TrainConfig(seed=7, steps=8, batch_size=4, warmup=2, block_sizes=[4, 32], threads=1), progress=False)
    stream = random.Random(tr.SIZE_STREAM + 7)
    assert sizes == seen == [stream.choice((4, 32)) for _ in range(8)] and set(sizes) == {4, 32}
    assert again.losses == first.losses
    seen[:] = []
    train(TrainConfig(seed=7, steps=3, batch_size=4, warmup=2, block_sizes=(), threads=1), progress=False)
    assert seen == [32, 32, 32]
    assert TrainConfig().block_sizes == (1, 2, 4, 8, 16, 32)      # the committed checkpoint's recipe
    for bad in ((5,), (0,), (64,), (True,)):
        with pytest.raises(ValueError, match="divide the model's block size 32"):
            TrainConfig(block_sizes=bad)


def test_next_token_batches_predict_the_following_token_under_a_causal_mask():
    """Protects SDAR's AR phase: every position but a sequence's last predicts the next token (logit shift), under
    a causal mask, with EOS padding never a target; a few AR steps then lower that loss."""
    b = ntp_batch([([5, 6], [7]), ([8], [9, 10, 11])], eos_id=2)
    assert b.ids.tolist() == [[5, 6, 7, 2, 2], [8, 9, 10, 11, 2]]
    assert b.mask.tolist() == torch.ones(5, 5, dtype=torch.bool).tril().tolist()
    assert b.rows.tolist() == [0, 1, 2, 5, 6, 7, 8] and b.targets.tolist() == [6, 7, 2, 9, 10, 11, 2]
    assert b.weights.tolist() == [1.0] * 7 and b.num_answer == 7 and b.positions.tolist() == [0, 1, 2, 3, 4]
    losses = train(TrainConfig(seed=7, steps=0, ar_steps=20, batch_size=8, warmup=5, threads=1), progress=False).losses
    assert len(losses) == 20 and sum(losses[-5:]) < 0.5 * sum(losses[:5])


def test_tasks_are_one_token_per_letter_and_split_by_prompt():
    """Protects: the corpus: every letter of the alphabet is one token (copy/reverse/sort act on tokens), answers
    are right, and held-out prompts are never drawn for training (and are a tenth of all prompts)."""
    tok = arch_tokenizer("sdar")
    assert all(len(tok.encode(a + b).ids) == 2 for a in LETTERS for b in LETTERS)
    rng = random.Random(0)
    for _ in range(200):
        ex = draw("reverse", rng, heldout=False)
        assert not held_out(ex.prompt) and ex.answer == ex.prompt[len("reverse:"):-1][::-1]
    ex = draw("add", rng, heldout=True)
    a, b = ex.prompt[4:-1].split("+")
    assert held_out(ex.prompt) and int(ex.answer) == int(a) + int(b)
    share = sum(held_out(f"add:{a}+{b}=") for a in range(100) for b in range(100)) / 10000
    assert 0.08 < share < 0.12
    assert len(eval_set(3)) == 3 * len(TASKS) and eval_set(3) == eval_set(3)
    with pytest.raises(ValueError, match="task 'add' has only 106 distinct held-out examples, 107 asked"):
        eval_set(107, tasks=("add",))            # a bounded search, not a hang


def test_committed_checkpoint_decodes_copy_with_the_reference_loop(tiny):
    """Protects: the committed tiny SDAR checkpoint loads (32768 ids, mask token, block 32) and the plain reference
    loop decodes held-out copy prompts exactly, ending at EOS; the cached loop gives the same tokens."""
    model, tok = tiny
    info = json.loads((TINY_SDAR / "config.json").read_text())
    assert info["vocab_size"] == 32768 and info["block_size"] == 32 and info["model_type"] == "sdar"
    assert tok.id_to_token(info["mask_token_id"]) == "<|mask|>"
    eos = info["eos_token_id"]
    params = SamplingParams(temperature=0, max_tokens=40)
    cfg = DllmConfig(dllm_confidence_threshold=0.9)
    prompts = [e for e in eval_set(4, tasks=("copy",))]
    for ex in prompts:
        out = generate_reference(model, tok.encode(ex.prompt).ids, params, cfg)
        assert out.token_ids == tok.encode(ex.answer).ids + [eos] and out.finish_reason == "stop", ex
    cached = generate_cached(model, [tok.encode(e.prompt).ids for e in prompts], params, cfg)
    assert [c.token_ids for c in cached] == [tok.encode(e.answer).ids + [eos] for e in prompts]


def test_evaluate_reports_accuracy_and_tokens_per_step(tiny):
    """Protects: evaluate() scores exact match per task (none for words) and counts committed and returned tokens
    per denoise step, with the settings it used."""
    model, tok = tiny
    rep = evaluate(model, tok, eval_set(2), DllmConfig(dllm_confidence_threshold=0.9))
    d = rep.as_dict()
    assert set(d["tasks"]) == set(TASKS) and d["tasks"]["words"]["accuracy"] is None
    assert d["tasks"]["copy"]["accuracy"] == 1.0
    assert d["overall"]["n"] == 2 * len(TASKS)
    assert d["settings"]["block_length"] == 32 and d["settings"]["strategy"] == "low_confidence_dynamic"
    for r in d["tasks"].values():
        assert r["committed_per_step"] >= r["output_per_step"] > 0
    assert "copy" in rep.table()


def test_cli_trains_a_checkpoint_that_loads(tmp_path, capsys):
    """Protects: `tandem tiny-model --arch sdar --train` trains, writes a loadable SDAR checkpoint with its training
    record and evaluation, and prints the table; --train refuses other archs."""
    out = tmp_path / "sdar"
    assert main(["tiny-model", "--arch", "sdar", "--train", "--train-steps", "3", "--eval-examples", "1",
                 "--train-threads", "1", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "trained tiny SDAR for 3 steps" in text and "copy" in text
    model, cfg = load_model(out, dtype="float32")
    assert cfg.diffusion_block_size == 32 and cfg.torch_dtype == "bfloat16"
    info = json.loads((out / "training.json").read_text())
    assert info["train_config"]["steps"] == 3 and info["eval"]["examples_per_task"] == 1
    assert main(["tiny-model", "--arch", "qwen3", "--train", "--out", str(tmp_path / "q")]) == 2
    capsys.readouterr()
    assert main(["tiny-model", "--arch", "sdar", "--train", "--eval-examples", "400", "--out",
                 str(tmp_path / "e")]) == 2                 # refused before any training step
    assert "--eval-examples 400: task 'add' has only 106" in capsys.readouterr().err
    assert not (tmp_path / "e").exists() or not any((tmp_path / "e").iterdir())
    assert main(["tiny-model", "--arch", "sdar", "--train-threads", "2", "--out", str(tmp_path / "t")]) == 2
    capsys.readouterr()
    assert main(["tiny-model", "--arch", "sdar", "--train-block-sizes", "4,8", "--out", str(tmp_path / "t")]) == 2
    assert "--train-block-sizes needs --train" in capsys.readouterr().err
    assert main(["tiny-model", "--arch", "sdar", "--train", "--train-block-sizes", "4,12", "--out",
                 str(tmp_path / "b")]) == 2
    assert "--train-block-sizes: training block sizes must divide the model's block size 32, got 12" in \
        capsys.readouterr().err
