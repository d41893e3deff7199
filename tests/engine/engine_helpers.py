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


class CharTok:
    """A minimal tokenizer for stop-string tests: token ``i`` <-> ``chr(ord('a') + i)``."""

    class _Enc:
        def __init__(self, ids):
            self.ids = ids

    def encode(self, s):
        return self._Enc([ord(c) - ord("a") for c in s])

    def decode(self, ids):
        return "".join(chr(ord("a") + i) for i in ids)


class _Replay:
    """A CUDA graph stand-in on CPU: ``replay`` reruns the captured body into its static output."""

    def __init__(self, body):
        self.body, self.out = body, body()

    def replay(self):
        self.out.copy_(self.body())


def simulate_decode_graphs(runner) -> list:
    """Make ``runner`` (a ``ModelRunner``) "capture" its decode graphs as :class:`_Replay`
    stand-ins (static inputs and outputs, each replay overwriting the output the previous
    step returned), with padded batches; returns the list the captured keys are appended to."""
    keys = []

    def capture(key, Bp, warm=True):
        s_in, t_in = runner._decode_inputs(Bp)
        kw = {"greedy": True} if key.kind == "gdecode" else {}
        g = _Replay(lambda: runner.model.decode(runner.cache, s_in, t_in, **kw))
        keys.append(key)
        runner._graphs[key] = (g, s_in, t_in, g.out)
        return runner._graphs[key]

    runner._capture_decode, runner.use_graphs = capture, True
    return keys
