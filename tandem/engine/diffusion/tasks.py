"""The synthetic corpus of the tiny SDAR model: predictable tasks mixed with unpredictable text.

Each example is a prompt and its answer, as plain text (no chat template): the predictable tasks have one right
answer that a model can work out from the prompt, so a trained model commits many of their tokens per step:

- copy `copy:bdfg=` -> `bdfg`, reverse `reverse:bdfg=` -> `gfdb`, sort `sort:gbfd=` -> `bdfg` (3-10 / 3-8 letters);
- count the letters `count:bdfg=` -> `4` (1-12 letters);
- add a digit to a number below 100 `add:47+8=` -> `55` (digit facts generalise to unseen pairs);

`words` answers `words:` with 3-8 random words (` river stone apple`), which no model can predict beyond the inside
of a word, so it commits few. Mixing them makes the tokens committed per step vary with content, as in real models.

Strings are drawn from letters that the tiny byte-level tokenizer never merges (no BPE merge starts with two of
them), so each letter is one token and copy/reverse/sort act on tokens. A fixed tenth of all prompts (by a CRC of
the prompt text) is held out: training never draws one, evaluation draws only those.
"""
from __future__ import annotations

import random
import zlib
from dataclasses import dataclass

TASKS = ("copy", "reverse", "sort", "count", "add", "words")
PREDICTABLE = ("copy", "reverse", "sort", "count", "add")      # tasks with one right answer (exact match)
LETTERS = "bdfghjklmpqrsuvwxyz"      # no tokenizer merge starts with a pair of these: one token per letter
WORDS = ("river stone apple cloud night green table window garden market silver orange yellow paper music "
         "winter summer spring autumn bridge forest rabbit mountain valley pocket butter candle engine planet "
         "rocket shadow thunder velvet wizard yogurt zebra anchor basket cactus dragon feather guitar hammer "
         "island jacket kettle ladder magnet needle oyster parrot quartz ribbon saddle tunnel umbrella violin "
         "walnut lemon mirror pencil puzzle rubber salmon tomato turtle wallet blanket cookie donkey falcon "
         "gravel harbor insect jungle kitten lizard meadow nickel orchid pepper pillow spider sugar timber").split()


@dataclass(frozen=True)
class Example:
    """One prompt and its expected answer, as text."""

    task: str
    prompt: str
    answer: str


def held_out(prompt: str) -> bool:
    """Whether a prompt belongs to the held-out tenth (never trained on)."""
    return zlib.crc32(prompt.encode()) % 10 == 0


def _letters(rng: random.Random, lo: int, hi: int) -> str:
    """A random string of lo..hi letters of LETTERS."""
    return "".join(rng.choice(LETTERS) for _ in range(rng.randint(lo, hi)))


def make_example(task: str, rng: random.Random) -> Example:
    """A random example of `task` (any split)."""
    if task == "copy":
        s = _letters(rng, 3, 10)
        return Example(task, f"copy:{s}=", s)
    if task == "reverse":
        s = _letters(rng, 3, 10)
        return Example(task, f"reverse:{s}=", s[::-1])
    if task == "sort":
        s = _letters(rng, 3, 8)
        return Example(task, f"sort:{s}=", "".join(sorted(s)))
    if task == "count":
        s = _letters(rng, 1, 12)
        return Example(task, f"count:{s}=", str(len(s)))
    if task == "add":
        a, b = rng.randint(0, 99), rng.randint(0, 9)
        return Example(task, f"add:{a}+{b}=", str(a + b))
    if task == "words":
        return Example(task, "words:", "".join(" " + rng.choice(WORDS) for _ in range(rng.randint(3, 8))))
    raise ValueError(f"unknown task {task!r} (valid: {', '.join(TASKS)})")


def draw(task: str, rng: random.Random, heldout: bool) -> Example:
    """A random example of `task` from the training split (heldout False) or the held-out split (True)."""
    while True:
        ex = make_example(task, rng)
        if task == "words" or held_out(ex.prompt) == heldout:     # words: nothing to learn, no split needed
            return ex


MAX_STALE_DRAWS = 20_000   # draws without a new example before eval_set concludes a task has no more


def eval_set(n_per_task: int, seed: int = 1234, tasks: tuple[str, ...] = TASKS) -> list[Example]:
    """n_per_task distinct held-out examples of each task, the same for a seed; ValueError when a task has fewer
    (`add` has about a hundred held-out prompts)."""
    rng = random.Random(seed)
    out: list[Example] = []
    for task in tasks:
        seen: set[tuple[str, str]] = set()
        stale = 0
        while len(seen) < n_per_task:
            ex = draw(task, rng, heldout=True)
            if (ex.prompt, ex.answer) in seen:
                stale += 1
                if stale > MAX_STALE_DRAWS:
                    raise ValueError(f"task {task!r} has only {len(seen)} distinct held-out examples, "
                                     f"{n_per_task} asked")
                continue
            stale = 0
            seen.add((ex.prompt, ex.answer))
            out.append(ex)
    return out
