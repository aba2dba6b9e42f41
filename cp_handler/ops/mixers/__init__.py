"""Sequence mixers other than attention under CP (causal convolutions by a halo of left context, linear
recurrences by state passing): the algorithms behind the handlers' mixer methods (docs/hybrid.md)."""
