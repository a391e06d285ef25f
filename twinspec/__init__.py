"""The definitions both frameworks implement, written once and importing no framework.

Recipe configs and their names, FP8/FP4 format constants, parameter roles and parallel modes, mesh
axes and their spellings, placement plans, the Llama config and the Hugging Face name table, the
transformer config and the argument checks that need no tensor (docs/twins.md lists them).
`fp8kernels`, `torchside`, `jaxside` and `bridge` import from here; this package imports none of them.
"""
