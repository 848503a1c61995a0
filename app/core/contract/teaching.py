"""Teaching a head by example, as the core takes it: the lesson an edge read (`Lesson`: a head's name, its classes
and the image files of each, from a request's body or a folder of the model repository), checked once here, and the
same lesson embedded (`Embedded`), which the engine fits a head on and keeps (`model.taught_head`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

import torch

from app.core.contract.errors import AlreadyExists, InvalidInput, NotAllowed
from app.core.contract.request import EncodedImage
from model.taught_head import HeadError, RuleSetting, check_head_name
from model.teach import examples_in


@dataclass(frozen=True)
class Lesson:
    """A head to teach: its name, its classes in answer order with each one's image files, the rule (auto, means
    or logistic) and whether a head of that name is replaced. Checked when built (InvalidInput)."""

    head: str
    examples: Mapping[str, Sequence[EncodedImage]]
    rule: RuleSetting = "auto"
    replace: bool = False

    def __post_init__(self) -> None:
        try:
            check_head_name(self.head)
        except HeadError as e:
            raise InvalidInput(str(e)) from None
        if self.rule not in get_args(RuleSetting):
            raise InvalidInput(f"rule must be one of {', '.join(get_args(RuleSetting))}; got {self.rule!r}")
        classes = list(self.examples)
        if any(not c.strip() for c in classes):
            raise InvalidInput("an empty class name: each class is the name of the form field its images come in")
        if len(classes) < 2:
            got = f"1 ({classes[0]})" if classes else "none"
            raise InvalidInput(
                f"a head tells classes apart: send images of at least two classes, each under its class name as the "
                f"field name; got {got}"
            )
        if empty := [c for c, images in self.examples.items() if not images]:
            raise InvalidInput(f"class {empty[0]!r} has no image: each class needs at least one example")

    @property
    def classes(self) -> tuple[str, ...]:
        return tuple(self.examples)

    @property
    def size(self) -> int:
        return sum(len(images) for images in self.examples.values())

    def check_against(self, model: str, heads: Mapping[str, object], max_examples: int) -> None:
        """NotAllowed when teaching over the API is off (`max_examples` 0), InvalidInput past that many images,
        AlreadyExists for a head name the model has, unless replacing."""
        check_teaching(max_examples)
        if self.size > max_examples:
            raise InvalidInput(
                f"{self.size} example images; at most {max_examples} teach one head here (VIT_TEACH_MAX_EXAMPLES)"
            )
        if self.head in heads and not self.replace:
            raise AlreadyExists(
                f"model {model} already has a head named {self.head!r}: choose another name, or replace it "
                "(replace=true), or delete it first"
            )


def check_teaching(max_examples: int) -> None:
    """NotAllowed where teaching over the API is off (VIT_TEACH_MAX_EXAMPLES=0)."""
    if max_examples == 0:
        raise NotAllowed(
            "teaching heads over the API is off here (VIT_TEACH_MAX_EXAMPLES=0); "
            "`python -m model.train --head DIR --backbone NAME` teaches one offline"
        )


def examples_in_folder(root: Path, folder: str) -> dict[str, list[EncodedImage]]:
    """The example images under `folder`, a path relative to the model repository `root` and inside it: each class
    a folder of images, `folder/<class>/*.jpg`, by class name (blocking). InvalidInput for a folder outside the
    repository or not there; a file whose link leads out of it is left out."""
    root = root.resolve()
    path = (root / folder).resolve()
    if Path(folder).is_absolute() or not path.is_relative_to(root):
        raise InvalidInput(f"folder {folder!r} is not inside the model repository: name one relative to it")
    if not path.is_dir():
        raise InvalidInput(f"no folder {folder!r} in the model repository")
    return {
        cls: [
            EncodedImage(f"{cls}/{file.name}", file.read_bytes())
            for file in files
            if file.resolve().is_relative_to(root)
        ]
        for cls, files in examples_in(path).items()
    }


@dataclass(frozen=True)
class Embedded:
    """A lesson's images embedded by the model it teaches: `embeddings` (N, D), the class index of each."""

    head: str
    classes: tuple[str, ...]
    labels: tuple[int, ...]
    embeddings: torch.Tensor
    rule: RuleSetting
    replace: bool

    @classmethod
    def of(cls, lesson: Lesson, embeddings: Sequence[torch.Tensor]) -> Embedded:
        """`lesson` with its images' embeddings, in the order its classes give them."""
        labels = tuple(k for k, images in enumerate(lesson.examples.values()) for _ in images)
        return cls(lesson.head, lesson.classes, labels, torch.stack(list(embeddings)), lesson.rule, lesson.replace)
