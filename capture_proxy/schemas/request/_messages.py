"""Chat Completions messages and content parts, as strict msgspec Structs.

Messages are a tagged union on ``role`` (``system``, ``developer``, ``user``, ``assistant``,
``tool``); content parts are a tagged union on ``type``. Every Struct forbids unknown fields, so a
key the schema does not know is refused with its JSON path instead of being dropped on the way to
vLLM (which silently ignores unknown keys, and would then render a prompt the client did not mean).

Which parts each role may carry follows the OpenAI reference: system, developer and tool messages
hold text; user messages hold text and images (plus the audio, file and video parts that are
*recognized* here so that `check_capturable` can refuse them with a clear reason); assistant
messages hold text and refusals. The legacy ``function`` role is not accepted: send ``tool``.

Assistant reasoning is ``reasoning_content`` here, the canonical name inside the service;
`capture_proxy.core.normalize.normalize_request` renames OpenCode's interleaved ``reasoning``
field to it before validation.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeAlias

from msgspec import Meta

from ._strict import Strict

__all__ = [
    "MAX_CONTENT_PARTS",
    "MAX_TOOL_CALLS",
    "UNSTORABLE_PARTS",
    "AssistantContentPart",
    "AssistantMessage",
    "AssistantToolCall",
    "AudioURL",
    "AudioURLPart",
    "DeveloperMessage",
    "FilePart",
    "FileRef",
    "FunctionCall",
    "ImagePart",
    "ImageURL",
    "InputAudio",
    "InputAudioPart",
    "Message",
    "RefusalPart",
    "SystemMessage",
    "TextPart",
    "ToolMessage",
    "UserContentPart",
    "UserMessage",
    "VideoURL",
    "VideoURLPart",
]

#: Content parts per message, tool calls per assistant message: far above what any agent sends,
#: low enough that a hostile body cannot make per-part loops the cost of a call.
MAX_CONTENT_PARTS = 4096
MAX_TOOL_CALLS = 1024

NonEmptyStr = Annotated[str, Meta(min_length=1)]


# -- content parts ------------------------------------------------------------------------------


class TextPart(Strict, tag="text", tag_field="type"):
    """``{"type": "text", "text": "..."}``."""

    text: str


class ImageURL(Strict):
    """``url`` is a ``data:image/...;base64,...`` URL (or, with ``--allow-remote-media``, an
    ``http(s)`` URL); ``detail`` is OpenAI's resolution hint."""

    url: NonEmptyStr
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(Strict, tag="image_url", tag_field="type"):
    """``{"type": "image_url", "image_url": {"url": ..., "detail"?: ...}}``: stored as an
    attachment (its bytes) and referred to by sha256 in the staged request."""

    image_url: ImageURL


class InputAudio(Strict):
    data: str
    format: str


class InputAudioPart(Strict, tag="input_audio", tag_field="type"):
    """Recognized so it can be refused by name: the capture stores no audio."""

    input_audio: InputAudio


class FileRef(Strict):
    file_data: str | None = None
    file_id: str | None = None
    filename: str | None = None


class FilePart(Strict, tag="file", tag_field="type"):
    """Recognized so it can be refused by name: the capture stores no files."""

    file: FileRef


class VideoURL(Strict):
    url: str


class VideoURLPart(Strict, tag="video_url", tag_field="type"):
    """vLLM extension. Recognized so it can be refused by name: the capture stores no video."""

    video_url: VideoURL


class AudioURL(Strict):
    url: str


class AudioURLPart(Strict, tag="audio_url", tag_field="type"):
    """vLLM extension. Recognized so it can be refused by name: the capture stores no audio."""

    audio_url: AudioURL


class RefusalPart(Strict, tag="refusal", tag_field="type"):
    """``{"type": "refusal", "refusal": "..."}`` in a replayed assistant message."""

    refusal: str


UserContentPart: TypeAlias = (
    TextPart | ImagePart | InputAudioPart | FilePart | VideoURLPart | AudioURLPart
)
AssistantContentPart: TypeAlias = TextPart | RefusalPart

TextContent = str | Annotated[list[TextPart], Meta(max_length=MAX_CONTENT_PARTS)]
UserContent = str | Annotated[list[UserContentPart], Meta(max_length=MAX_CONTENT_PARTS)]
AssistantContent = (
    str | Annotated[list[AssistantContentPart], Meta(max_length=MAX_CONTENT_PARTS)] | None
)


# -- tool calls -----------------------------------------------------------------------------------


class FunctionCall(Strict):
    """``arguments`` is the JSON text of the arguments, exactly as the client replays it (OpenCode
    re-serializes it compactly, a known source of tokenization drift)."""

    name: NonEmptyStr
    arguments: str


class AssistantToolCall(Strict):
    """``{"id", "type": "function", "function": {"name", "arguments"}}``."""

    id: NonEmptyStr
    function: FunctionCall
    type: Literal["function"] = "function"


# -- messages -------------------------------------------------------------------------------------


class SystemMessage(Strict, tag="system", tag_field="role"):
    content: TextContent
    name: str | None = None


class DeveloperMessage(Strict, tag="developer", tag_field="role"):
    content: TextContent
    name: str | None = None


class UserMessage(Strict, tag="user", tag_field="role"):
    content: UserContent
    name: str | None = None


class AssistantMessage(Strict, tag="assistant", tag_field="role"):
    """A replayed assistant turn. OpenCode sends ``{"content": "", "tool_calls": [...]}`` for a
    turn that only called tools, with its reasoning under ``reasoning`` (renamed to
    ``reasoning_content`` by normalization) or ``reasoning_content``."""

    content: AssistantContent = None
    reasoning_content: str | None = None
    tool_calls: Annotated[list[AssistantToolCall], Meta(max_length=MAX_TOOL_CALLS)] | None = None
    name: str | None = None
    refusal: str | None = None


class ToolMessage(Strict, tag="tool", tag_field="role"):
    """A tool result: ``{"role": "tool", "tool_call_id": ..., "content": ...}``."""

    tool_call_id: NonEmptyStr
    content: TextContent


Message: TypeAlias = SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage

#: Part types recognized by the schema that the capture cannot store (see `check_capturable`).
UNSTORABLE_PARTS: dict[type[Any], str] = {
    InputAudioPart: "audio",
    AudioURLPart: "audio",
    FilePart: "files",
    VideoURLPart: "video",
}
