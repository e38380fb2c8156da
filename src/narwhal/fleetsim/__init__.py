"""The virtual-time fleet simulator: the router's own routing driven by a discrete-event model
of the engines, with no processes and no sleeping (``narwhal-fleetsim``)."""
