"""Graph passes: find routing sites in a torch.fx graph and rewrite them.

``matcher`` recognises a routing site (top-k over the expert dimension whose indices
reach expert dispatch) in Python-level fx graphs, Dynamo graphs and ATen-level graphs
(torch.export / AOT) alike, by first mapping every node to a canonical op kind.
``rewrite`` inserts the re-routing call on the index path to the experts only.
"""

from sere_fx.passes.matcher import RoutingMatchError, RoutingSite, find_routing_sites, match_router
from sere_fx.passes.rewrite import insert_reroute

__all__ = ["RoutingMatchError", "RoutingSite", "find_routing_sites", "match_router", "insert_reroute"]
