"""A chat message's `content` as the chat template takes it: text (a string, or OpenAI text parts
joined), or, when it holds image parts (OpenAI ``image_url``), a list of text and image parts that a
vision-language model's template renders (hpcrl.inference.vision)."""

from __future__ import annotations

from typing import Any

# The only image form the server takes (vLLM's contract too, without --allowed-local-media-path): a
# path or an http(s) URL is refused before anything reads the filesystem or the network.
from hpcrl.models.vision_inputs import DATA_URL  # the one pattern of an image data URL


class ContentError(ValueError):
    """A message content the server cannot take (hpcrl.inference.protocol names the request field)."""


def _image_url(part: Any) -> str | None:
    ref = part.get("image_url") if isinstance(part, dict) and part.get("type") == "image_url" else None
    url = ref.get("url") if isinstance(ref, dict) else ref
    return url if isinstance(url, str) else None


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: only text parts make sense for a text model
        parts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise ContentError(f"{where}: only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise ContentError(f"{where}: `content` must be a string or a list of text parts")


def message_content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """Text content as one string; content with image parts as normalised text / image_url parts."""
    if not (isinstance(content, list) and any(_image_url(p) is not None for p in content)):
        return _text(content, where)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        url = _image_url(part)
        if url is not None:
            if not DATA_URL.match(url):
                raise ContentError(
                    f"{where}.content[{j}].image_url: only data:image/...;base64, URLs are accepted "
                    f"(got {url[:40]!r}); the server reads no file nor URL"
                )
            parts.append({"type": "image_url", "image_url": {"url": url}})
        elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            raise ContentError(f"{where}.content[{j}]: only text and image_url parts are supported")
    return parts


def has_images(messages: list[dict[str, Any]]) -> bool:
    """Whether message_content kept image parts in any of the (parsed) messages."""
    return any(isinstance(m.get("content"), list) for m in messages)
