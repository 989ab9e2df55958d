"""Every Redis key Strata uses, defined once. All live under the `strata:` prefix."""

PREFIX = "strata"


def replica(replica_id: str) -> str:
    """Hash: a replica's registry entry; expires with its lease unless the heartbeat refreshes it."""
    return f"{PREFIX}:replica:{replica_id}"


def model_replicas(model: str) -> str:
    """Set: replica ids registered for a model (entries may be stale; check replica() exists)."""
    return f"{PREFIX}:model:{model}:replicas"


def prefix_block(model: str, block_hash: int) -> str:
    """Set: replicas holding the KV block with this hash."""
    return f"{PREFIX}:prefix:{model}:{block_hash}"


def replica_blocks(model: str, replica_id: str) -> str:
    """Set: block hashes a replica holds, for cleanup when it goes away."""
    return f"{PREFIX}:prefix_replica:{model}:{replica_id}"


def replica_blocks_seq(model: str, replica_id: str) -> str:
    """String: the last KV event batch seq applied to the index for a replica."""
    return f"{PREFIX}:prefix_seq:{model}:{replica_id}"


def resync_lock(model: str, replica_id: str) -> str:
    """Short-lived lock: one scheduler at a time rebuilds a replica's index entries."""
    return f"{PREFIX}:prefix_resync:{model}:{replica_id}"


def api_key(key_hash: str) -> str:
    """Hash: tenant name and limits of an API key, by the key's SHA-256."""
    return f"{PREFIX}:apikey:{key_hash}"


def rate_counter(key_hash: str, kind: str, window: int) -> str:
    """Counter of requests or tokens for one key in one minute window."""
    return f"{PREFIX}:rate:{key_hash}:{kind}:{window}"


def deployment(name: str) -> str:
    """Hash: a deployment's live state: stable and canary revisions, canary weight, routing
    policy, latest revision number, generation (see services.control.store)."""
    return f"{PREFIX}:deployment:{name}"


def service(kind: str, instance: str) -> str:
    """Hash: a gateway's or scheduler's registry entry (http_url, ...), with a TTL lease."""
    return f"{PREFIX}:service:{kind}:{instance}"


def services(kind: str) -> str:
    """Set: instances of one kind of service that registered (entries may be stale)."""
    return f"{PREFIX}:services:{kind}"


def deployment_revision(name: str, revision: int) -> str:
    """String: one immutable revision's spec, as JSON."""
    return f"{PREFIX}:deployment:{name}:revision:{revision}"


def deployment_history(name: str) -> str:
    """List: the deployment's change events, oldest first, as JSON."""
    return f"{PREFIX}:deployment:{name}:history"


def deployment_analysis(name: str) -> str:
    """String: the canary analysis of the deployment's current (or last) canary, as JSON
    (services.control.canary_driver writes it; the API, CLI and dashboard read it)."""
    return f"{PREFIX}:deployment:{name}:analysis"


def lora_adapters(model: str) -> str:
    """Hash: LoRA adapters served on a model (deployment): name -> JSON {path, source} (shared.adapters)."""
    return f"{PREFIX}:lora:{model}"


DEPLOYMENTS = f"{PREFIX}:deployments"  # Set: names of deployments stored by control


def pool(name: str) -> str:
    """String: a capacity pool's spec as JSON, with its generation (see shared.pools)."""
    return f"{PREFIX}:pool:{name}"


POOLS = f"{PREFIX}:pools"  # Set: names of capacity pools stored by control


MODELS = f"{PREFIX}:models"  # Set: models that ever had a registered replica


def deployment_deleted(name: str) -> str:
    """String (with a TTL): control deleted this deployment (its last generation). A deployment
    missing from the store without one was lost with the store's data, not deleted: readers hold
    their copy (shared.deployments)."""
    return f"{PREFIX}:deployment:{name}:deleted"


STORE_EPOCH = f"{PREFIX}:store_epoch"  # String: a random id; gone or changed = the store lost its data
