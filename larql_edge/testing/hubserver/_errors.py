"""The one exception type route handlers raise to answer with an HTTP error.

The Hub answers errors with a JSON body ``{"error": "..."}`` and, for the cases ``huggingface_hub`` tells apart,
an ``X-Error-Code`` header (``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``, ``GatedRepo``) plus an
``X-Error-Message`` header. ``huggingface_hub.utils.hf_raise_for_status`` maps those to its exception classes.
"""

from __future__ import annotations

from typing import Any


class HubError(Exception):
    """An HTTP error answer: status, message, optional ``X-Error-Code`` and extra JSON body fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        body: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.body = dict(body or {})
        self.headers = dict(headers or {})


def repo_not_found(repo_type: str, repo_id: str) -> HubError:
    return HubError(404, f"Repository {repo_type}s/{repo_id} not found", code="RepoNotFound")


def revision_not_found(revision: str) -> HubError:
    return HubError(404, f"Invalid rev id: {revision}", code="RevisionNotFound")


def entry_not_found(path: str, commit: str | None = None) -> HubError:
    headers = {"X-Repo-Commit": commit} if commit else None
    return HubError(404, f"Entry not found: {path}", code="EntryNotFound", headers=headers)
