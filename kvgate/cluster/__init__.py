"""kvgate on Ray Serve: many replicas behind one OpenAI endpoint, routed by truthful admission.

Install with `pip install 'kvgate[ray]'`; run with `kvgate cluster --replicas N [engine flags]`, or
as a Serve application (`kvgate.cluster.app:build_app`). The parts:

- `views`    what a replica reports about itself (`ReplicaView`), and the cluster's sum of them
- `routing`  pure admission-aware ranking: fits now, holds, prefix affinity, the single 429
- `replica`  the replica deployment: an engine that admits now or refuses, streaming its events
- `router`   the Serve request routers (kvgate's, and Serve's default for comparison)
- `dispatch` two-phase admission across replicas, with retries before any header
- `remote`   ingress-side handles shaped like the engine's, so the server's code runs unchanged
- `facade`   `ClusterEngine`: the replicas as one engine for `kvgate.server.create_app`
- `ingress`  the ingress deployment: the server's app plus /health, resources and metrics of a cluster
- `app`      the Serve application and its options; `cli` the `kvgate cluster` command

`views` and `routing` import no Ray; everything else needs the `ray` extra.
"""
