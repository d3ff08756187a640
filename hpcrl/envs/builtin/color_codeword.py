"""color-codeword: a vision-language task (prime-rl's multimodal reference task, made locally).

Each colour has a codeword, listed in the system prompt; the user turn shows `images_per_turn` small
images, each a solid colour (or, with `patterns = true`, two colours in halves, named by the left
one), as OpenAI ``image_url`` parts with PNG data URLs drawn here with PIL. The answer is the images'
codewords in order, separated by spaces; the reward is 1 for an exact match (case and surrounding
whitespace ignored), else 0, and `codeword_accuracy` (the share of images named right) is reported;
`similarity_weight` adds that much of the reply's character similarity to the answer (a dense signal
for a model that never answers right yet, e.g. a tiny random one).
"""

from __future__ import annotations

import base64
import io
import random
from typing import Any

from hpcrl.envs.base import Message, Rubric, Task
from hpcrl.envs.builtin._common import (
    GeneratedEnvironment,
    builtin_loader,
    last_assistant_text,
    similarity,
    strip_think,
)

# colour name -> (RGB, codeword)
COLOURS: dict[str, tuple[tuple[int, int, int], str]] = {
    "red": ((220, 20, 20), "apple"),
    "green": ((20, 180, 40), "leaf"),
    "blue": ((30, 60, 220), "ocean"),
    "yellow": ((240, 220, 30), "sun"),
    "black": ((0, 0, 0), "night"),
    "white": ((255, 255, 255), "snow"),
    "purple": ((130, 30, 160), "plum"),
    "orange": ((250, 140, 20), "ember"),
}


def png_data_url(rgb: tuple[int, int, int], size: int, right: tuple[int, int, int] | None = None) -> str:
    """A `size` x `size` PNG of one colour (or `rgb` left / `right` right halves) as a data URL."""
    from PIL import Image

    img = Image.new("RGB", (size, size), rgb)
    if right is not None:
        img.paste(Image.new("RGB", (size - size // 2, size), right), (size // 2, 0))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def system_prompt_text(colours: list[str]) -> str:
    table = ", ".join(f"{c} = {COLOURS[c][1]}" for c in colours)
    return f"Each colour has a codeword: {table}. Answer with the codeword of each image's colour, in order."


def _answers(text: str) -> list[str]:
    return strip_think(text).strip().lower().split()


def exact_match(task: Task, completion: list[Message], state: dict[str, Any]) -> float:
    return float(_answers(last_assistant_text(completion)) == task.answer.split())


def codeword_accuracy(task: Task, completion: list[Message], state: dict[str, Any]) -> float:
    want, got = task.answer.split(), _answers(last_assistant_text(completion))
    return sum(a == b for a, b in zip(want, got)) / len(want)


def answer_similarity(task: Task, completion: list[Message], state: dict[str, Any]) -> float:
    return similarity(strip_think(last_assistant_text(completion)).strip().lower(), task.answer)


class ColorCodewordEnv(GeneratedEnvironment):
    name = "color-codeword"

    def __init__(
        self,
        *,
        images_per_turn: int,
        image_size: int,
        num_colours: int,
        patterns: bool,
        similarity_weight: float,
        system_prompt: str | None,
        **kw: Any,
    ):
        rubric = [(exact_match, 1.0), (codeword_accuracy, 0.0), (answer_similarity, similarity_weight)]
        super().__init__(Rubric(rubric), **kw)
        self.images_per_turn, self.image_size, self.patterns = images_per_turn, image_size, patterns
        self.colours = list(COLOURS)[:num_colours]
        self.system_prompt = system_prompt_text(self.colours) if system_prompt is None else system_prompt

    def make_task(self, rng: random.Random):
        picks = [rng.choice(self.colours) for _ in range(self.images_per_turn)]
        seconds = [rng.choice(self.colours) if self.patterns else None for _ in picks]
        parts: list[dict[str, Any]] = [
            {
                "type": "image_url",
                "image_url": {
                    "url": png_data_url(COLOURS[c][0], self.image_size, None if s is None else COLOURS[s][0])
                },
            }
            for c, s in zip(picks, seconds)
        ]
        n = self.images_per_turn
        parts.append({"type": "text", "text": "What is the codeword?" if n == 1 else f"The {n} codewords?"})
        prompt: list[Message] = []
        if self.system_prompt:
            prompt.append({"role": "system", "content": self.system_prompt})
        prompt.append({"role": "user", "content": parts})
        answer = " ".join(COLOURS[c][1] for c in picks)
        # the task space is small (4 colours, 1 image: 4 prompts): tasks repeat, each its own example
        return rng.getrandbits(64), prompt, answer, {"colours": picks}


def _check(
    images_per_turn: int, image_size: int, num_colours: int, patterns: bool, similarity_weight: float
) -> None:
    if images_per_turn < 1:
        raise ValueError(f"images_per_turn must be >= 1, got {images_per_turn}")
    if not 8 <= image_size <= 1024:
        raise ValueError(f"image_size must be in 8..1024 pixels, got {image_size}")
    if not 2 <= num_colours <= len(COLOURS):
        raise ValueError(f"num_colours must be in 2..{len(COLOURS)}, got {num_colours}")
    if similarity_weight < 0:
        raise ValueError(f"similarity_weight must be >= 0, got {similarity_weight}")


load_environment = builtin_loader(
    ColorCodewordEnv,
    {"images_per_turn": 1, "image_size": 32, "num_colours": 4, "patterns": False, "similarity_weight": 0.0},
    check=_check,
    num_examples=1000,
    num_eval_examples=64,
    num_val_examples=32,
    system_prompt=None,
    doc="""images_per_turn: images in the user turn (the answer lists one codeword each); image_size:
    their side in pixels; num_colours: how many of the colours (red, green, blue, yellow, black, white,
    purple, orange) tasks use; patterns: two-colour images named by their left half; similarity_weight:
    reward for the reply's character similarity to the answer. system_prompt None: the codeword table.""",
)
