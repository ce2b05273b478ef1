"""Small parquet files in the layout of the paper's published data (veRL's: ``hf download lukhuang/vcpo``):
``data_source``, ``prompt`` (a list of ``{role, content}`` messages), ``ability``, ``reward_model``
(``{style, ground_truth}``; Countdown's ground truth is ``{target, numbers}``) and ``extra_info``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def gsm8k_rows(n: int = 3) -> list[dict[str, Any]]:
    rows = []
    for i in range(n):
        a, b = 10 + i, 7 * (i + 1)
        rows.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": [
                    {
                        "role": "user",
                        "content": f"Tom has {a} apples and buys {b} more. How many? " + GSM8K_INSTRUCTION,
                    }
                ],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"split": "train", "index": i, "answer": f"{a}+{b}={a + b}\n#### {a + b}"},
            }
        )
    return rows


def math_rows(n: int = 2) -> list[dict[str, Any]]:
    answers = ["\\frac{1}{2}", "3\\sqrt{2}", "10"][:n]
    return [
        {
            "data_source": "lighteval/MATH",
            "prompt": [
                {
                    "role": "user",
                    "content": f"Problem {i}. Let's think step by step and output the final "
                    "answer within \\boxed{}.",
                }
            ],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": "test", "index": i},
        }
        for i, answer in enumerate(answers)
    ]


def countdown_rows(n: int = 2) -> list[dict[str, Any]]:
    specs = [(24, [2, 3, 4]), (10, [1, 2, 7]), (50, [5, 5, 2])][:n]
    return [
        {
            "data_source": "countdown",
            "prompt": [
                {
                    "role": "user",
                    "content": f"Using the numbers {nums}, create an equation that equals "
                    f"{target}. Show your work in <think> </think> tags. And return the final answer in "
                    "<answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>.",
                }
            ],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": {"target": target, "numbers": nums}},
            "extra_info": {"split": "train", "index": i},
        }
        for i, (target, nums) in enumerate(specs)
    ]


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path
