"""Text needles: key-value sentences hidden at a depth of real filler text, and a query for each at the end.

Needle in a haystack (Kamradt 2023), with several keys per context as RULER's multi-query needles (Hsieh et al.
2024, "RULER: What's the Real Context Size of Your Long-Context Language Models?"): every needle is asked for.
"""

from __future__ import annotations

import torch

from lengthgen.config import check_value
from lengthgen.data.tasks.base import Batch
from lengthgen.data.text.packing import TextData

#: the needle sentence, the query and the answer that follows the query (the scored tokens)
NEEDLE = "\nThe passkey for {key} is {value}.\n"
QUERY = "\nWhat is the passkey for {key}? The passkey for {key} is"
ANSWER = " {value}"
KEY_LETTERS, VALUE_DIGITS = 6, 5


class TextNeedles:
    """A source for the evaluator: rows ``[BOS] filler.. NEEDLES filler.. QUERY1 ANSWER1 .. QUERYK ANSWERK``.

    Each row has ``needles`` = K keys (distinct random words of `KEY_LETTERS` lowercase letters) with values
    (`VALUE_DIGITS` random digits). The K `NEEDLE` sentences form one block preceded by exactly
    ``round(depth * F)`` (Python's round) of the row's F filler tokens: depth 0 puts it right after BOS, depth 1
    right before the first query. The filler is ``data``'s documents back to back (`TextData.plain_tokens`) from a
    uniformly drawn start. Pieces are tokenized separately and joined as ids, so the row has exactly L + 1 tokens:
    ``tokens`` the first L, ``targets`` the last L; only answer tokens are scored. The same generator draws the
    same filler, keys and values at every depth.

    ``extra["answer"]``: (B, L) long, the key's index at its answer's positions, -1 elsewhere;
    ``extra["needle_pos"]``: (B,) long, the position of the needle block's first token in ``tokens``.
    """

    head = "lm"
    max_length = None
    min_length = 1

    def __init__(self, data: TextData, depth: float, needles: int = 1) -> None:
        if data.tokenizer is None:
            raise ValueError(f"text needles need the tokenizer of {data.name!r}; build it with make_text_data")
        self.data, self.tokenizer = data, data.tokenizer
        self.depth = check_value("depth", depth, float, ge=0, le=1)
        self.needles = check_value("needles", needles, int, ge=1)
        self.vocab_size, self.name = data.vocab_size, data.name

    def _keys(self, generator: torch.Generator) -> tuple[list[str], list[str]]:
        """K distinct keys and their values (a row whose keys repeat is drawn again)."""
        while True:
            letters = torch.randint(26, (self.needles, KEY_LETTERS), generator=generator).tolist()
            digits = torch.randint(10, (self.needles, VALUE_DIGITS), generator=generator).tolist()
            keys = ["".join(chr(97 + c) for c in word) for word in letters]
            if len(set(keys)) == self.needles:
                return keys, ["".join(map(str, value)) for value in digits]

    def _row(self, length: int, start: int, generator: torch.Generator) -> tuple[list[int], list[int], int]:
        """One row's L + 1 token ids, the answer index of each (-1: not scored), and the needle's position."""
        keys, values = self._keys(generator)
        encode = self.tokenizer.encode
        block = encode("".join(NEEDLE.format(key=k, value=v) for k, v in zip(keys, values)))
        ids, answer = [], []
        for i, (key, value) in enumerate(zip(keys, values)):
            query, reply = encode(QUERY.format(key=key)), encode(ANSWER.format(value=value))
            ids += query + reply
            answer += [-1] * len(query) + [i] * len(reply)
        filler = length - len(block) - len(ids)        # L + 1 tokens in all, one of them BOS
        if filler < 0:
            raise ValueError(f"text needles: length {length} is too short for {self.needles} needle(s) and their "
                             f"queries ({len(block) + len(ids) + 1} tokens)")
        text = self.data.plain_tokens(start, filler).tolist()
        before = round(self.depth * filler)
        row = [self.tokenizer.bos_id] + text[:before] + block + text[before:] + ids
        return row, [-1] * (len(row) - len(answer)) + answer, 1 + before

    def sample(self, count: int, length: int, generator: torch.Generator) -> Batch:
        check_value("TextNeedles.count", count, int, ge=1)
        check_value("TextNeedles.length", length, int, ge=1)
        starts = torch.randint(self.data.stream.num_tokens, (count,), generator=generator).tolist()
        rows, answers, positions = zip(*(self._row(length, start, generator) for start in starts))
        rows, answers = torch.tensor(rows), torch.tensor(answers)
        return Batch(rows[:, :-1], rows[:, 1:], answers[:, 1:] >= 0, torch.zeros(count, length, dtype=torch.long),
                     extra={"answer": answers[:, 1:], "needle_pos": torch.tensor(positions)})

    def chance(self, metric: str, length: int) -> None:
        """None: a language model's trivial baseline on these answers is not defined here."""
        return None


__all__ = ["ANSWER", "KEY_LETTERS", "NEEDLE", "QUERY", "TextNeedles", "VALUE_DIGITS"]
