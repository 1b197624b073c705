"""Prompts for load runs: a built-in set, or a file.

A file is JSON (a list of strings, or `{"prompts": [...]}` whose items are strings or
objects with a `chat`, `text` or `prompt` field, as bench/default_prompts.json) or plain
text with one prompt per line.
"""

from __future__ import annotations

import json
from pathlib import Path

BUILTIN = [
    "Explain how a refrigerator keeps food cold.",
    "Write a short poem about the first snow of winter.",
    "What are the main differences between a virus and a bacterium?",
    "Describe the rules of chess for someone who has never played.",
    "Summarize the causes of the French Revolution.",
    "How does compound interest work? Give an example.",
    "Write a friendly email declining a meeting invitation.",
    "List five tips for learning a new language as an adult.",
    "What is the difference between weather and climate?",
    "Explain recursion to a ten-year-old.",
    "Describe a walk through a busy market in the morning.",
    "Why is the sky blue during the day and red at sunset?",
    "Give a recipe for a simple vegetable soup.",
    "What makes a good password, and why?",
    "Explain how vaccines train the immune system.",
    "Write the opening paragraph of a mystery novel set on a train.",
    "Compare renting and buying a home.",
    "How do airplanes stay in the air?",
    "Describe the water cycle step by step.",
    "What should I pack for a three-day hiking trip?",
    "Explain what a hash table is and when to use one.",
    "Tell a short story about a lighthouse keeper and a storm.",
    "What are the benefits of regular exercise for the brain?",
    "How does a bill become a law in a parliamentary system?",
    "Explain the difference between speed and velocity.",
    "Write a product description for a handmade wooden chair.",
    "What causes earthquakes, and can they be predicted?",
    "Give advice to someone starting their first job.",
    "Explain how photosynthesis turns light into sugar.",
    "Describe the life cycle of a star like the Sun.",
    "What is inflation, and how do central banks respond to it?",
    "Write a dialogue between a cat and a dog about breakfast.",
]


def load_prompts(source: str) -> list[str]:
    """`builtin` or a path to a prompts file."""
    if source == "builtin":
        return list(BUILTIN)
    path = Path(source)
    text = path.read_text()
    if path.suffix != ".json":
        prompts = [line for line in text.splitlines() if line.strip()]
    else:
        data = json.loads(text)
        items = data["prompts"] if isinstance(data, dict) else data
        prompts = [item if isinstance(item, str) else _field(item) for item in items]
    if not prompts:
        raise SystemExit(f"{source}: no prompts")
    return prompts


def _field(item: dict) -> str:
    for key in ("chat", "text", "prompt"):
        if key in item:
            return item[key]
    raise SystemExit(f"a prompt object needs a chat, text or prompt field: {item}")
