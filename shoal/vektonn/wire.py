"""Vektonn's wire format straight to and from columns, as the HTTP routes call it: one name per entry point.

The work lives in modules by idea; this module only gathers the entry points the routes (and the bench) call as
`wire.<name>`:

- shoal.vektonn.json_fields: the fields both JSON bodies share (attributes, values, vectors) and their rules;
- shoal.vektonn.upload_json: the JSON upload body to the validated batch table (a fast column-wise path, and
  the exact path that reports problems as the former DTO path did);
- shoal.vektonn.arrow_upload: the Arrow IPC upload body to the same table;
- shoal.vektonn.search_json: the JSON search query, its vectors and split filter;
- shoal.vektonn.search_response: the search results as the JSON pydantic wrote.
"""

from __future__ import annotations

from shoal.vektonn.arrow_upload import decode_arrow_upload
from shoal.vektonn.search_json import decode_search, query_vectors, split_filter
from shoal.vektonn.search_response import encode_search_results
from shoal.vektonn.upload_json import decode_upload

__all__ = [
    "decode_arrow_upload", "decode_search", "decode_upload", "encode_search_results", "query_vectors", "split_filter",
]
