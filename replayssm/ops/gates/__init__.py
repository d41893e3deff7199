"""Per-token gate preparation of the recurrent mixers: reference op in ``naive``."""
