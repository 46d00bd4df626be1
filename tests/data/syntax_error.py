def build_model(cfg):
    return (
