"""Networks (plain nn.Modules) and the LightningModule that trains them."""
