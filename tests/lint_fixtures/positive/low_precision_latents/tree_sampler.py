"""low-precision-latents in a BranchGRPO-style tree sampler: the returned log-prob lists go unread, but each
node carries its own log-prob beside its bf16 latent to the trainer. Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""

import torch


class TreeNode:
    def __init__(self, node_id, latent, parent=None):
        self.node_id = node_id
        self.latent = latent
        self.parent = parent
        self.log_prob = None


def run_tree_sample_step(transformer, root_latents, sigmas, flux_step_with_split):
    nodes = [TreeNode("root", root_latents)]
    all_path_log_probs = []
    for i in range(len(sigmas) - 1):
        new_nodes = []
        for node in nodes:
            pred = transformer(node.latent, sigmas[i])
            next_latents, _, log_probs = flux_step_with_split(pred.float(), node.latent.float(), sigmas, i)
            child = TreeNode(f"{node.node_id}_{i}", next_latents.to(torch.bfloat16), parent=node)  # expect: low-precision-latents
            child.log_prob = log_probs
            new_nodes.append(child)
            all_path_log_probs.append(log_probs)
        nodes = new_nodes
    return nodes, all_path_log_probs


def sample_tree(transformer, root_latents, sigmas, flux_step_with_split):
    leaf_nodes, _ = run_tree_sample_step(transformer, root_latents, sigmas, flux_step_with_split)
    return [{"latent": leaf.latent, "log_prob": leaf.log_prob} for leaf in leaf_nodes]
