"""Which searcher processes serve which shards: configuration, read once at startup (SHOAL_PLACEMENT_FILE).

Placement is a file every process reads the same way, not a membership protocol: an operator names the nodes
(searcher processes, each by the URL of its API) and, per index, the shards each serves. A shard may be placed on
several nodes (replicas; they are tried in the order listed). A process started with SHOAL_NODE loads only the
shards placed on it and asks the other nodes for the rest; an index the file does not list is served whole by
every process, as without a placement.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from shoal.errors import ConfigurationError

IndexKey = tuple[str, str, str]  # (tenant, index name, index version)


def url_problem(url: str) -> str | None:
    """What is wrong with a node's URL as the base of its API, in words (None when nothing is): http or https, a
    host, a port from 1 to 65535 when one is given; a path is kept (a node behind a proxy's prefix: the search
    route is appended to it), a query, a fragment or credentials are not (the route appended would not be where
    they expect). Checked at load: a bad URL failed every search asking the node with a retryable 503."""
    if not url.startswith(("http://", "https://")):
        return "must start with http:// or https://"
    if any(c.isspace() or not c.isprintable() for c in url):
        return "must have no spaces or control characters"
    try:
        parts = urlsplit(url)
        port = parts.port  # ValueError past 65535, or not a number
    except ValueError as exc:
        return f"is not a valid URL ({exc})"
    if not parts.hostname:
        return "names no host"
    if port == 0:
        return "has port 0: give the port the node's API listens on (1-65535)"
    if parts.query or parts.fragment or "?" in url or "#" in url:
        return "must have no query (?) or fragment (#): it is the base the search route is appended to"
    if parts.username is not None or parts.password is not None:
        return "must carry no credentials: a part carries the caller's own key"
    return None


@dataclass(frozen=True)
class IndexPlacement:
    """One index's shards by node: `nodes[shard]` lists the nodes serving it, in the order they are tried; and
    the shards placed on this process's node (none for a process that is no node), read by every search."""

    nodes: Mapping[int, tuple[str, ...]]
    local: frozenset[int]

    @property
    def spans(self) -> bool:
        """True when a search of the index needs shards this process does not serve."""
        return len(self.local) < len(self.nodes)


@dataclass(frozen=True)
class Placement:
    """Nodes (name -> base URL of its API), this process's node, and the placed indexes."""

    urls: Mapping[str, str] = field(default_factory=dict)
    node: str | None = None
    indexes: Mapping[IndexKey, IndexPlacement] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path | None, node: str | None) -> Placement:
        """The placement the file describes, for the process named `node`; an empty placement without a file.
        Raises ConfigurationError naming what is wrong in the file."""
        if path is None:
            if node is not None:
                raise ConfigurationError("SHOAL_NODE is set but SHOAL_PLACEMENT_FILE is not: name the placement "
                                         "file that lists the node")
            return cls()
        try:
            document = yaml.safe_load(Path(path).read_text())
        except OSError as exc:
            raise ConfigurationError(f"cannot read the placement file {path}: {exc.strerror or exc}") from None
        except yaml.YAMLError as exc:
            raise ConfigurationError(f"placement file {path} is not valid YAML: {exc}") from None
        return cls.parse(document, node, str(path))

    @classmethod
    def parse(cls, document: Any, node: str | None, where: str = "placement") -> Placement:
        """The placement of a parsed document (see config/placement.yaml.example)."""
        def bad(what: str) -> ConfigurationError:
            return ConfigurationError(f"{where}: {what}")

        if not isinstance(document, dict) or set(document) - {"nodes", "indexes"}:
            raise bad("expected a mapping with `nodes` and `indexes` (and nothing else)")
        nodes = document.get("nodes") or {}
        if not isinstance(nodes, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in nodes.items()):
            raise bad("`nodes` must map each node's name to the base URL of its API")
        for name, url in nodes.items():
            problem = url_problem(url)
            if problem:
                raise bad(f"node {name!r}: URL {url!r} {problem}")
        if node is not None and node not in nodes:
            raise bad(f"SHOAL_NODE {node!r} is not among its nodes ({', '.join(sorted(nodes)) or 'none'})")
        indexes: dict[IndexKey, IndexPlacement] = {}
        entries = document.get("indexes") or []
        if not isinstance(entries, list):
            raise bad("`indexes` must be a list")
        for i, entry in enumerate(entries):
            if not isinstance(entry, dict) or set(entry) != {"tenant", "index", "version", "shards"}:
                raise bad(f"indexes[{i}] must have exactly `tenant`, `index`, `version` and `shards`")
            for part in ("tenant", "index", "version"):
                if type(entry[part]) not in (str, int):
                    # YAML reads `version: 1.10` as the float 1.1: the index placed would be another one (or none),
                    # and this process would load every shard of the real one without a word. (An integer reads
                    # back as written: `version: 1` is "1".)
                    raise bad(f"indexes[{i}].{part} must be a string: quote it ({part}: \"{entry[part]}\" "
                              f"is read as {type(entry[part]).__name__} {entry[part]!r})")
            key = (str(entry["tenant"]), str(entry["index"]), str(entry["version"]))
            if key in indexes:
                raise bad(f"index {key[1]}/{key[2]} of tenant {key[0]} is placed twice")
            shards = entry["shards"]
            if not isinstance(shards, dict) or not shards:
                raise bad(f"indexes[{i}].shards must map node names to lists of shard numbers")
            by_shard: dict[int, list[str]] = {}
            for name, numbers in shards.items():
                if name not in nodes:
                    raise bad(f"indexes[{i}]: node {name!r} is not among `nodes`")
                if not isinstance(numbers, list) or not all(type(n) is int and n >= 0 for n in numbers):
                    raise bad(f"indexes[{i}].shards.{name} must be a list of shard numbers (integers from 0)")
                if len(set(numbers)) < len(numbers):  # the node would be asked twice, as its own replica
                    twice = sorted({n for n in numbers if numbers.count(n) > 1})
                    raise bad(f"indexes[{i}].shards.{name} lists shard(s) {', '.join(map(str, twice))} twice")
                for n in numbers:
                    by_shard.setdefault(n, []).append(name)
            local = frozenset(n for n, names in by_shard.items() if node in names)
            indexes[key] = IndexPlacement({n: tuple(names) for n, names in sorted(by_shard.items())}, local)
        return cls(dict(nodes), node, indexes)

    def of(self, tenant: str, name: str, version: str) -> IndexPlacement | None:
        """The index's placement, or None when every process serves it whole."""
        return self.indexes.get((tenant, name, version)) if self.indexes else None

    def local_shards(self, tenant: str, name: str, version: str) -> frozenset[int] | None:
        """The shards of the index this process loads: None for all of them (the index is not placed)."""
        placed = self.of(tenant, name, version)
        return None if placed is None else placed.local
