//! Warm start from peers: replicas put snapshots in a JetStream object store.
