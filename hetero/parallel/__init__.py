"""Tensor- and context-parallel pieces the models are built with: CP attention (gathered, tiled, by heads), CP
Mamba, the vocab-parallel cross entropy, and the choice between fused kernels and torch. May import runtime,
plan and models; build (hetero/build/model_build.py) and the stages hand them to the models, which never import
them (process groups are injected)."""
