"""Several narwhal-serve replicas, one fleet: engine roles shared through etcd, one leader (an
etcd lease) deciding flips, each replica's demand published for the leader to read."""

from narwhal.coordination.etcd import EtcdClient, EtcdUnavailable
from narwhal.coordination.replica import Coordinator, SharedRoles, parse_coordination_url

__all__ = [
    "Coordinator",
    "EtcdClient",
    "EtcdUnavailable",
    "SharedRoles",
    "parse_coordination_url",
]
