"""A dataset's life outside the trash: create (or overwrite), list, read, update, reindex."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shoal.datasets import rules
from shoal.datasets.catalog import MARKER, LogTotals, definition
from shoal.datasets.errors import DatasetError, ErrorCode, already_exists, invalid, problems_of
from shoal.datasets.results import Dataset, Page, ReindexStarted
from shoal.datasets.scope import DatasetScope
from shoal.errors import AlreadyExistsError, NotFoundError, ReindexConflictError, ValidationError
from shoal.index.spec import resolve_index
from shoal.log.records import DataSourceSpec, IndexSpec

MUTABLE_FIELDS = ("description", "metadata")
# How often an overwrite create looks again at what the name holds when other requests keep dropping or
# replacing it under it (each look that loses means another request changed the name meanwhile).
OVERWRITE_ATTEMPTS = 3


def _replaced_meanwhile(name: str) -> DatasetError:
    """A create lost its data source to another request (an overwrite create or a delete of the name) before it
    was done: nothing of it is left."""
    return DatasetError(
        ErrorCode.DATASET_ALREADY_EXISTS,
        f"dataset {name!r} was replaced or deleted by another request while this one created it",
        {"dataset_id": name, "conflict": "dataset",
         "action": "send the request again (GET /api/v1/datasets/{dataset_id} shows what the name holds now)"},
    )


class Lifecycle(DatasetScope):
    """Create, list, read, update and reindex datasets."""

    def create(
        self,
        name: Any,
        dimensions: Any,
        *,
        metric_type: Any = rules.DEFAULT_METRIC,
        index_type: Any = None,
        description: Any = None,
        metadata: Any = None,
        index_params: Any = None,
        index_config: Any = None,
        overwrite: bool = False,
    ) -> Dataset:
        """Create a dataset (with `overwrite`, first hard-delete a dataset of that name); the new dataset.
        Undone as far as possible if any step fails.

        The index: `index_type` (None or "default": hnsw, or flat for manhattan, the one metric only flat
        serves) with the parameters of `index_config` (the specified form, which may also name the type) or
        `index_params` (the older one); parameters left out take the dataset API's defaults and must lie in
        its ranges (`rules.index_params_of`)."""
        name = rules.check_name(name)
        dimensions = rules.check_dimensions(dimensions)
        metric_type = rules.check_choice("metric_type", metric_type, rules.METRIC_TYPES)
        index_type, params = rules.check_index_choice(metric_type, index_type, index_params, index_config)
        description = rules.check_description(description)
        metadata = rules.check_custom_metadata(rules.check_metadata(metadata))
        plain = DataSourceSpec(name, rules.VERSION, dimensions, rules.ATTRIBUTES, rules.PERMANENT)
        index_spec = IndexSpec(name, rules.VERSION, name, rules.VERSION, algorithm=index_type, metric=metric_type,
                               params=params, id_attributes=rules.PERMANENT, shard_count=1)
        try:
            resolved = resolve_index(index_spec, plain)
        except ValidationError as exc:
            raise DatasetError(
                ErrorCode.INVALID_DATASET_CONFIG,
                f"index_type {index_type!r} with metric_type {metric_type!r} and these index parameters is "
                "refused: " + "; ".join(problems_of(exc)),
                {"field": "index_config" if index_config is not None else "index_params",
                 "problems": problems_of(exc), "index_type": index_type, "metric_type": metric_type},
            ) from None
        params = dict(resolved.params)
        spec = DataSourceSpec(
            name, rules.VERSION, dimensions, rules.ATTRIBUTES, rules.PERMANENT, description=description or "",
            custom_metadata={MARKER: definition(description, metadata, metric_type, index_type, params)},
        )

        existing = self.catalog.find(name)
        for _ in range(OVERWRITE_ATTEMPTS):
            if existing is None:
                break
            if not overwrite:
                raise already_exists(name)
            try:
                self._drop(existing)
                break
            except DatasetError as exc:
                if exc.code is not ErrorCode.DATASET_NOT_FOUND:
                    raise
                # Another request deleted (or moved to the trash, or replaced) the dataset first: what the
                # name holds now is what this create replaces, or nothing, and it creates anew.
                existing = self.catalog.find(name)
        else:
            if existing is not None:
                raise _replaced_meanwhile(name)
        self._refuse_foreign(name)
        self._forget(name)
        try:
            created = self.shoal.catalog.create_data_source(spec)  # the catalog's own: the facade refuses our key
        except AlreadyExistsError:
            raise already_exists(name) from None
        except NotFoundError:  # dropped right after its insert committed (and before it was read back)
            raise _replaced_meanwhile(name) from None
        try:
            self.shoal.create_index(index_spec)
            record = self.catalog.get(name)
            if record.source_id != created.id:  # ours was dropped, and another request made the dataset anew
                raise _replaced_meanwhile(name)
            self._write_mirror(record)
        except BaseException as exc:
            self._drop_quietly(name, created.id)
            if isinstance(exc, AlreadyExistsError):
                raise already_exists(name, "index") from None
            # The data source was dropped meanwhile: another request (an overwrite create, a delete) took the
            # name over. Not "not found", which a create never answers.
            if isinstance(exc, NotFoundError) or (isinstance(exc, DatasetError)
                                                  and exc.code is ErrorCode.DATASET_NOT_FOUND):
                raise _replaced_meanwhile(name) from None
            raise
        finally:
            self._forget(name)
        return self._dataset(record, LogTotals())

    def _refuse_foreign(self, name: str) -> None:
        """A data source or index of the dataset's name that is not a dataset's blocks it (never overwritten)."""
        for kind, lookup in (("data_source", self.shoal.get_data_source), ("index", self.shoal.get_index)):
            try:
                lookup(name, rules.VERSION)
            except NotFoundError:
                continue
            if self.catalog.find(name) is not None:  # a dataset after all, which another request is creating
                raise DatasetError(ErrorCode.DATASET_ALREADY_EXISTS,
                                   f"dataset {name!r} was created by another request meanwhile",
                                   {"dataset_id": name, "conflict": "dataset"})
            raise DatasetError(
                ErrorCode.DATASET_ALREADY_EXISTS,
                f"a {kind.replace('_', ' ')} named {name!r} version {rules.VERSION!r} exists and is not a dataset",
                {"dataset_id": name, "conflict": kind,
                 "action": "choose another name (overwrite replaces datasets only)"},
            )

    def list(self, limit: int = 100, offset: int = 0) -> Page[Dataset]:
        """A page of the tenant's datasets, by name."""
        self._check_page(limit, offset)
        page = self.cache.get_list(self.tenant_id, limit, offset) if self.cache is not None else None
        if page is None:
            # Read before the catalog, so a page read before a change is never cached after it (as `record`).
            generation = self.cache.list_generation(self.tenant_id) if self.cache is not None else None
            page = self.catalog.page(limit, offset)
            if self.cache is not None and generation is not None:
                self.cache.set_list(self.tenant_id, limit, offset, *page, generation)
        records, total = page
        return Page(tuple(self._datasets(records)), total, limit, offset)

    def get(self, name: Any) -> Dataset:
        """The dataset; DATASET_NOT_FOUND if the tenant has none of that name."""
        return self._datasets([self.record(name)])[0]

    def update(self, name: Any, changes: Mapping[str, Any]) -> Dataset:
        """Change the description and/or metadata (a field left out stays, null clears it); the dataset after."""
        name = self._lookup_name(name)
        self.catalog.get(name)  # DATASET_NOT_FOUND before any complaint about the body
        other = sorted(set(changes) - set(MUTABLE_FIELDS))
        if other:
            raise DatasetError(
                ErrorCode.INVALID_DATASET_CONFIG,
                f"only description and metadata may change; refused: {', '.join(other)}",
                {"fields": other, "mutable_fields": list(MUTABLE_FIELDS)},
            )
        clean: dict[str, Any] = {}
        if "description" in changes:
            clean["description"] = rules.check_description(changes["description"])
        if "metadata" in changes:
            clean["metadata"] = rules.check_custom_metadata(rules.check_metadata(changes["metadata"]))
        if not clean:
            return self.get(name)
        self._forget(name)
        try:
            record = self.catalog.update(name, clean)
            self._write_mirror(record)
        finally:
            self._forget(name)
        return self._datasets([record])[0]

    def reindex(
        self, name: Any, index_type: str | None = None, index_params: Mapping[str, Any] | None = None,
        *, index_config: Any = None, wait: bool = False,
    ) -> ReindexStarted:
        """Rebuild the dataset's index (optionally with another type or params) as a new generation swapped in
        once its recall meets the gate; `wait` runs it here, else a worker does. REINDEX_CONFLICT if one runs.

        The type and params come from `index_type` and `index_params`, or from `index_config` (the params,
        optionally with `index_type`; `index_type` may also be given beside it if the two agree); "default" is
        the type a new dataset of its metric gets. Without params the current ones are kept, unless a type is
        named; params left out take the dataset API's defaults, and its ranges hold (as on create). A refused
        `index_config` is INVALID_DATASET_CONFIG naming the field, and nothing is started. Once the new
        generation serves, the dataset (its catalog entry, stats and `dataset_metadata.json`) shows it."""
        # The definition serving now: another process may have reindexed it since the cached record was read.
        record = self._current([self.record(name)])[0]
        # What a refusal of the engine names: the field the caller gave the type or parameters in.
        asked = "index_config" if index_config is not None else (
            "index_params" if index_params is not None else "index_type")
        if index_config is not None:
            index_type, index_params = self._from_index_config(index_config, index_type, index_params)
        elif index_type is not None and index_type not in (*rules.INDEX_TYPES, rules.DEFAULT_INDEX_VALUE):
            raise invalid(f"index_type must be one of {', '.join(rules.INDEX_TYPES)}", index_type=index_type)
        if index_type == rules.DEFAULT_INDEX_VALUE:  # after comparing: "default" agrees with any type
            index_type = rules.default_index_type(record.metric_type)
        if index_type is not None or index_params is not None:
            # As on create: the parameters left out take the dataset API's defaults, and its ranges hold.
            field = "index_config" if index_config is not None else "index_params"
            index_params = rules.index_params_of(index_type or record.index_type, index_params, field)
        try:
            job = self.shoal.reindex(record.name, rules.VERSION, algorithm=index_type,
                                     params=dict(index_params) if index_params is not None else None, wait=wait)
        except ValidationError as exc:
            # The engine refused the type or parameters (e.g. hnsw for manhattan): as create answers it.
            raise DatasetError(
                ErrorCode.INVALID_DATASET_CONFIG, f"{asked} refused: " + "; ".join(problems_of(exc)),
                {"field": asked, "problems": problems_of(exc)[:100], "index_type": index_type or record.index_type,
                 "metric_type": record.metric_type},
            ) from None
        except ReindexConflictError as exc:
            raise DatasetError(ErrorCode.REINDEX_CONFLICT, str(exc), {"dataset_id": record.name}) from None
        finally:
            # A reindex run here (`wait`) swapped a generation in: the next reads cache the new definition.
            if wait:
                self._forget(record.name)
        return ReindexStarted(record.name, job)

    @staticmethod
    def _from_index_config(
        config: Any, index_type: str | None, index_params: Mapping[str, Any] | None
    ) -> tuple[str | None, dict[str, Any] | None]:
        """The index type and params an `index_config` asks for, checked against the other fields given."""
        if index_params is not None:
            raise DatasetError(ErrorCode.INVALID_DATASET_CONFIG,
                               "give the parameters in index_config or in index_params, not both",
                               {"field": "index_params"})
        config_type, params = rules.check_index_config(config)
        if index_type is not None:
            index_type = rules.check_choice("index_type", index_type, (*rules.INDEX_TYPES, rules.DEFAULT_INDEX_VALUE))
            # "default" (either side) agrees with any type, as on create; the type named wins.
            if rules.DEFAULT_INDEX_VALUE not in (index_type, config_type) and config_type not in (None, index_type):
                raise DatasetError(
                    ErrorCode.INVALID_DATASET_CONFIG,
                    f"index_type {index_type!r} and index_config.index_type {config_type!r} disagree",
                    {"field": "index_config.index_type"},
                )
            if config_type in (None, rules.DEFAULT_INDEX_VALUE):
                return index_type, params
        return config_type, params
