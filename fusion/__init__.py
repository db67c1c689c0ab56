"""Pure planning for adaptive eager: window -> dependency graph -> fusion groups -> fused
kernels. Knows nothing about op interception. Installed as ``adaptive_eager.fusion``."""
