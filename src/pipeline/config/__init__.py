"""Configuration: schema, YAML + Hydra override loading, model registry, cluster profiles."""
