"""Trinity's asynchronous loop (``mode: both``), apart from ``make test``: make test-async."""
