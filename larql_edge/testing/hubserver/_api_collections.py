"""Collection routes (``huggingface_hub`` collection methods and LARQL's ``ensure_collection``)."""

from __future__ import annotations

from ._collections import CollectionRecord, CollectionStore
from ._errors import HubError
from ._handler import BaseHubHandler

LIST_MAX_ITEMS = 4  # the Hub truncates each collection's items to 4 in listings


class CollectionRoutes(BaseHubHandler):
    def _visible(self, rec: CollectionRecord) -> bool:
        return not rec.private or (self.auth_state == "valid" and self.acting_user == rec.namespace)

    def _collection(self, slug: str) -> CollectionRecord:
        rec = self.hub.collections.get(slug)
        if not self._visible(rec):
            raise HubError(404, f"Collection {slug} not found")
        return rec

    def h_collections_list(self, owner: str | None = None) -> None:
        owners = [owner] if owner else self.query.get("owner")
        recs = [r for r in self.hub.collections.list(owners=owners, items=self.query.get("item")) if self._visible(r)]
        limit = self.qget("limit")
        if limit:
            try:
                recs = recs[: max(0, int(limit))]
            except ValueError as exc:
                raise HubError(400, f"Invalid limit {limit!r}") from exc
        payload = [CollectionStore.to_json(r, position=None, max_items=LIST_MAX_ITEMS) for r in recs]
        self.send_json(200, payload)

    def h_collection_create(self) -> None:
        body = self.read_json()
        rec = self.hub.collections.create(
            body.get("namespace") or self.acting_user,
            body.get("title") or "",
            description=body.get("description"),
            private=bool(body.get("private")),
        )
        self.send_json(200, CollectionStore.to_json(rec))

    def h_collection_get(self, slug: str) -> None:
        self.send_json(200, CollectionStore.to_json(self._collection(slug)))

    def h_collection_update(self, slug: str) -> None:
        self._collection(slug)
        rec = self.hub.collections.update(slug, self.read_json())
        self.send_json(200, {"success": True, "data": CollectionStore.to_json(rec)})

    def h_collection_delete(self, slug: str) -> None:
        self._collection(slug)
        self.hub.collections.delete(slug)
        self.send_json(200, {"success": True})

    def h_collection_item_add(self, slug: str) -> None:
        self._collection(slug)
        body = self.read_json()
        item = body.get("item") or {}
        rec = self.hub.collections.add_item(
            slug, str(item.get("id") or ""), str(item.get("type") or ""), body.get("note")
        )
        self.send_json(200, CollectionStore.to_json(rec))

    def h_collection_item_update(self, slug: str, object_id: str) -> None:
        self._collection(slug)
        rec = self.hub.collections.update_item(slug, object_id, self.read_json())
        self.send_json(200, {"success": True, "data": CollectionStore.to_json(rec)})

    def h_collection_item_delete(self, slug: str, object_id: str) -> None:
        self._collection(slug)
        self.read_body()
        self.hub.collections.delete_item(slug, object_id)
        self.send_json(200, {"success": True})
