"""A user's Dataset of dict samples and its collate function, as source text: the tests write it
into a project directory of the user's, beside their model, and run `orch` there."""

PAIRS_DATASET = '''

class Pairs(torch.utils.data.Dataset):
    def __init__(self, samples: int, features: int = 8):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(samples, features, generator=g)
        self.y = self.x.sum(-1) / features ** 0.5

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


def collate(samples):
    return {"x": torch.stack([s["x"] for s in samples]), "y": torch.stack([s["y"] for s in samples])}
'''
