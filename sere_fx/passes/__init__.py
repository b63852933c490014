"""Graph passes: find routing sites in a torch.fx graph and rewrite them.

``matcher`` recognises a routing site (top-k over the expert dimension whose indices
reach expert dispatch) in Python-level fx graphs, Dynamo graphs and ATen-level graphs
(torch.export / AOT) alike, by first mapping every node to a canonical op kind.
``rewrite`` inserts a routing policy's call (re-routing on the index path to the experts
only, or a replacement top-k).
"""

from sere_fx.passes.matcher import RoutingMatchError, RoutingSite, find_routing_sites, match_router
from sere_fx.passes.rewrite import SiteAttrs, insert_policy

__all__ = ["RoutingMatchError", "RoutingSite", "find_routing_sites", "match_router", "insert_policy", "SiteAttrs"]
