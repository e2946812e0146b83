"""Collections: titled, ordered lists of Hub items owned by a namespace.

JSON shapes follow what ``huggingface_hub.Collection`` / ``CollectionItem`` parse (``slug``, ``title``, ``owner``,
``items[{_id, id, type, position, note}]``, ``lastUpdated``, ``position``, ``private``, ``theme``, ``upvotes``).
A slug is ``{namespace}/{slugified-title}-{24 hex}``, as on the Hub.
"""

from __future__ import annotations

import hashlib
import itertools
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ._errors import HubError
from ._storage import now_iso

ITEM_TYPES = ("model", "dataset", "space", "paper", "collection", "bucket")


def slugify(title: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")
    return slug or "collection"


@dataclass
class CollectionItemRecord:
    object_id: str
    item_id: str
    item_type: str
    position: int
    note: str | None = None


@dataclass
class CollectionRecord:
    slug: str
    title: str
    namespace: str
    description: str | None
    private: bool
    theme: str = "default"
    upvotes: int = 0
    last_updated: str = field(default_factory=now_iso)
    items: list[CollectionItemRecord] = field(default_factory=list)


class CollectionStore:
    """Thread-safe collection registry. `item_exists(type, id)` decides whether model/dataset items exist."""

    def __init__(self, item_exists: Callable[[str, str], bool]) -> None:
        self._item_exists = item_exists
        self._lock = threading.RLock()
        self._by_slug: dict[str, CollectionRecord] = {}
        self._ids = itertools.count(1)

    def _new_id(self) -> str:
        return hashlib.sha1(f"{time.time_ns()}-{next(self._ids)}".encode()).hexdigest()[:24]

    # ------------------------------------------------------------- queries
    def get(self, slug: str) -> CollectionRecord:
        with self._lock:
            rec = self._by_slug.get(slug)
        if rec is None:
            raise HubError(404, f"Collection {slug} not found")
        return rec

    def find_by_title(self, namespace: str, title: str) -> CollectionRecord | None:
        with self._lock:
            for rec in self._by_slug.values():
                if rec.namespace == namespace and rec.title.lower() == title.lower():
                    return rec
        return None

    def list(self, *, owners: list[str] | None = None, items: list[str] | None = None) -> list[CollectionRecord]:
        """Newest-updated first. `items` entries look like ``datasets/ns/name`` or ``models/ns/name``."""
        with self._lock:
            recs = list(self._by_slug.values())
        if owners:
            recs = [r for r in recs if r.namespace in owners]
        if items:
            wanted = set()
            for it in items:
                kind, _, ident = it.partition("/")
                wanted.add((kind.rstrip("s"), ident))
            recs = [r for r in recs if any((i.item_type, i.item_id) in wanted for i in r.items)]
        return sorted(recs, key=lambda r: r.last_updated, reverse=True)

    # ------------------------------------------------------------- mutations
    def create(
        self, namespace: str, title: str, *, description: str | None = None, private: bool = False
    ) -> CollectionRecord:
        """Create; HTTP 409 (with the existing slug in the body) if the namespace has one with this title."""
        if not title or not namespace:
            raise HubError(400, "title and namespace are required")
        with self._lock:
            existing = self.find_by_title(namespace, title)
            if existing is not None:
                raise HubError(409, "Collection already exists", body={"slug": existing.slug})
            rec = CollectionRecord(
                slug=f"{namespace}/{slugify(title)}-{self._new_id()}",
                title=title,
                namespace=namespace,
                description=description,
                private=bool(private),
            )
            self._by_slug[rec.slug] = rec
            return rec

    def update(self, slug: str, changes: dict[str, Any]) -> CollectionRecord:
        with self._lock:
            rec = self.get(slug)
            for key in ("title", "description", "private", "theme"):
                if key in changes and changes[key] is not None:
                    setattr(rec, key, changes[key])
            rec.last_updated = now_iso()
            return rec

    def delete(self, slug: str) -> None:
        with self._lock:
            if self._by_slug.pop(slug, None) is None:
                raise HubError(404, f"Collection {slug} not found")

    def add_item(self, slug: str, item_id: str, item_type: str, note: str | None = None) -> CollectionRecord:
        """Append; 404 if a model/dataset item does not exist, 409 if the item is already in the collection."""
        if item_type not in ITEM_TYPES or not item_id:
            raise HubError(400, f"Invalid item {item_type!r}/{item_id!r}")
        if item_type in ("model", "dataset") and not self._item_exists(item_type, item_id):
            raise HubError(404, f"{item_type.capitalize()} {item_id} not found", code="RepoNotFound")
        with self._lock:
            rec = self.get(slug)
            if any(i.item_id == item_id and i.item_type == item_type for i in rec.items):
                raise HubError(409, f"Item {item_type}/{item_id} is already in collection {slug}")
            position = max((i.position for i in rec.items), default=-1) + 1
            rec.items.append(CollectionItemRecord(self._new_id(), item_id, item_type, position, note))
            rec.last_updated = now_iso()
            return rec

    def _find_item(self, rec: CollectionRecord, object_id: str) -> CollectionItemRecord:
        for item in rec.items:
            if item.object_id == object_id:
                return item
        raise HubError(404, f"Item {object_id} not found in collection {rec.slug}")

    def update_item(self, slug: str, object_id: str, changes: dict[str, Any]) -> CollectionRecord:
        with self._lock:
            rec = self.get(slug)
            item = self._find_item(rec, object_id)
            if changes.get("note") is not None:
                item.note = str(changes["note"])
            if changes.get("position") is not None:
                rec.items.remove(item)
                rec.items.insert(max(0, int(changes["position"])), item)
                for pos, it in enumerate(rec.items):
                    it.position = pos
            rec.last_updated = now_iso()
            return rec

    def delete_item(self, slug: str, object_id: str) -> CollectionRecord:
        with self._lock:
            rec = self.get(slug)
            rec.items.remove(self._find_item(rec, object_id))
            rec.last_updated = now_iso()
            return rec

    # ------------------------------------------------------------- JSON
    @staticmethod
    def to_json(rec: CollectionRecord, *, position: int | None = 0, max_items: int | None = None) -> dict[str, Any]:
        """Collection JSON. Listings pass `position=None` (the client numbers them) and `max_items=4`."""
        items = sorted(rec.items, key=lambda i: i.position)
        if max_items is not None:
            items = items[:max_items]
        out = {
            "slug": rec.slug,
            "title": rec.title,
            "description": rec.description,
            "owner": {"name": rec.namespace, "type": "user", "fullname": rec.namespace, "isPro": False},
            "items": [
                {
                    "_id": i.object_id,
                    "id": i.item_id,
                    "type": i.item_type,
                    "position": i.position,
                    **({"repoType": i.item_type} if i.item_type in ("model", "dataset") else {}),
                    **({"note": {"text": i.note, "html": i.note}} if i.note is not None else {}),
                }
                for i in items
            ],
            "lastUpdated": rec.last_updated,
            "private": rec.private,
            "theme": rec.theme,
            "upvotes": rec.upvotes,
            "isUpvotedByUser": False,
            "shareUrl": f"/collections/{rec.slug}",
            "gating": False,
        }
        if position is not None:
            out["position"] = position
        return out
