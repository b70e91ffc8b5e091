//! `VRAM_ALLOC_CONF` is read by `from_env`. A test binary of its own, with one test, so that
//! setting the variable races with nothing.

use vram_alloc::{AllocatorConfig, CachingAllocator, ENV_VAR, VirtualMemory};

#[test]
fn from_env_reads_vram_alloc_conf_and_rejects_bad_values() {
    // SAFETY: this test binary runs this single test; no other thread reads the environment.
    unsafe { std::env::set_var(ENV_VAR, "max_split_size_mb:128,expandable_segments:True") };
    let cache = CachingAllocator::from_env(VirtualMemory::new(1 << 30)).unwrap();
    assert_eq!(cache.config().max_split_size(), 128 << 20);
    assert!(cache.config().expandable_segments());

    // SAFETY: as above.
    unsafe { std::env::set_var(ENV_VAR, "max_split_size_mb:128,expandible_segments:True") };
    let err = AllocatorConfig::from_env().unwrap_err();
    assert_eq!(err.key, "expandible_segments");
    assert!(CachingAllocator::from_env(VirtualMemory::new(1 << 30)).is_err());

    // SAFETY: as above.
    unsafe { std::env::remove_var(ENV_VAR) };
    assert_eq!(AllocatorConfig::from_env().unwrap(), AllocatorConfig::default());
}
