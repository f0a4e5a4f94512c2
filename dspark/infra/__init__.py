"""Cluster specs, placement plans, network namespaces, services and manifests."""
