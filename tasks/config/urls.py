"""What the config's URL and free-form fields may hold: an allow-list per field, never a credential.

Every URL field (`storage.root`, `model.path`, `data.path`, `data.eval_path`, `tracking.uri`,
`tracking.ui_url`, `rollout.sglang.urls`, `rollout.sglang.router_url`) says where something is: a
URL without a user (`http://TOKEN@host`), a query (`?key=...`) or a fragment, or a plain path.
`model.chat_template_kwargs` takes only the switches chat templates document. What each refusal
says is where the credential goes instead (`source.CREDENTIALS_GO`); the value is never shown.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError

from tasks.config.source import CREDENTIALS_GO

__all__ = ["CHAT_TEMPLATE_SWITCHES", "PlainUrl", "check_chat_template_kwargs", "plain_url"]


def plain_url(value: str | None) -> str | None:
    """`value` when it is a plain path, or a URL with no user, query or fragment; else ValueError
    saying where credentials go (the value is never shown: it may hold one)."""
    if value is None or "://" not in value:
        return value
    parts = urlsplit(value)
    if "@" in parts.netloc or parts.query or parts.fragment or "?" in value or "#" in value:
        raise ValueError(
            "a URL here says where something is, never with what credential: scheme://host[:port]/path with no "
            f"user, query or fragment; {CREDENTIALS_GO}"
        )
    return value


PlainUrl = Annotated[str, AfterValidator(plain_url)]


class _ChatTemplateSwitches(BaseModel):
    """The documented switches of chat templates (Qwen3's `enable_thinking`, DeepSeek-V3.1's
    `thinking`, gpt-oss's `reasoning_effort`): typed strictly, no other name."""

    model_config = ConfigDict(strict=True, extra="forbid")

    enable_thinking: bool | None = None
    thinking: bool | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None


CHAT_TEMPLATE_SWITCHES = tuple(_ChatTemplateSwitches.model_fields)


def check_chat_template_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The kwargs when each is a documented chat-template switch of its type; else ValueError naming them."""
    unknown = sorted(set(kwargs) - set(CHAT_TEMPLATE_SWITCHES))
    if unknown:
        shown = [name[:40] for name in unknown]
        raise ValueError(
            f"{shown} are not switches a chat template documents; it takes {list(CHAT_TEMPLATE_SWITCHES)} "
            f"(a chat template takes no credential; {CREDENTIALS_GO})"
        )
    try:
        _ChatTemplateSwitches.model_validate(kwargs)
    except ValidationError as err:
        raise ValueError("; ".join(f"{e['loc'][0]}={e['input']!r}: {e['msg']}" for e in err.errors())) from None
    return kwargs
