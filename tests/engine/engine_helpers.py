import torch

PROMPTS = [[1, 2, 3], [5], [7, 7, 7, 1], [9, 4, 9, 4, 9, 4, 9], list(range(20))]


def reference_greedy(model, prompt, n):
    """Plain greedy decoding by full forwards (the ground truth)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ids = torch.tensor([prompt])
    out = []
    for _ in range(n):
        t = int(model(ids)[0, -1].argmax())
        out.append(t)
        ids = torch.cat([ids, torch.tensor([[t]])], 1)
    torch.set_num_threads(threads)
    return out
