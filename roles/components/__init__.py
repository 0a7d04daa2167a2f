"""What a role daemon holds or calls behind endpoints it declares itself: the advantage component
the actor owns (`advantage.Advantages`) and the weight-sync functions (`weight_sync`: a trainer
rank publishes, a generation daemon applies). None of them is mixed into a daemon class. Imports
hfrt.daemon and roles/ helpers; never the controller side."""
